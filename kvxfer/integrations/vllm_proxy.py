"""An OpenAI-compatible proxy in front of prefill (P) and decode (D) ``vllm serve``
instances running :class:`~kvxfer.integrations.vllm.KVXferConnector`.

Per request (``/v1/completions``, ``/v1/chat/completions``), as vLLM's own
disaggregated-serving proxy examples do: pick a P and a D (round robin), send
the request to P with ``max_tokens=1``, ``stream=false`` and
``kv_transfer_params={"do_remote_decode": true}``; P prefills, keeps the
prompt's blocks leased and answers with the ``kv_transfer_params`` D needs;
then send the original request with those params to D and relay D's answer
(streamed as it comes when the client asked for ``stream``). ``/v1/models``
and ``/health`` are answered from D.

Example::

    app = make_app(["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"])
"""
# no `from __future__ import annotations`: FastAPI must see the real Request class in signatures

import contextlib
import itertools
import json

TIMEOUT_S = 600.0


def make_app(prefill_urls, decode_urls, *, timeout: float = TIMEOUT_S, transport=None):
    """FastAPI app proxying to ``prefill_urls`` and ``decode_urls`` (non-empty lists).
    ``transport``: an ``httpx.AsyncBaseTransport`` for the upstream client (tests)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one prefill and one decode URL")
    p_cycle, d_cycle = itertools.cycle(list(prefill_urls)), itertools.cycle(list(decode_urls))
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), transport=transport)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="kvxfer proxy", lifespan=lifespan)

    async def prefill(path: str, body: dict) -> dict:
        req = dict(body, max_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        req.pop("stream_options", None)
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        r = await client.post(next(p_cycle) + path, json=req)
        if r.status_code != 200:
            raise _Upstream(r.status_code, r.content)
        params = r.json().get("kv_transfer_params")
        if not params:
            raise _Upstream(502, json.dumps({"error": "prefill instance returned no kv_transfer_params "
                                                      "(is it running KVXferConnector as kv_producer?)"}).encode())
        return params

    async def relay(path: str, request: Request):
        body = await request.json()
        try:
            params = await prefill(path, body)
        except _Upstream as exc:
            return Response(exc.body, status_code=exc.status, media_type="application/json")
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"prefill instance unreachable: {exc}"}, status_code=502)
        body["kv_transfer_params"] = params
        d_url = next(d_cycle) + path
        if not body.get("stream"):
            try:
                r = await client.post(d_url, json=body)
            except httpx.HTTPError as exc:
                return JSONResponse({"error": f"decode instance unreachable: {exc}"}, status_code=502)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        upstream = await client.send(client.build_request("POST", d_url, json=body), stream=True)

        async def chunks():
            try:
                async for chunk in upstream.aiter_bytes():  # decoded: our response sets its own headers
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), status_code=upstream.status_code, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        r = await client.get(next(d_cycle) + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        for url in list(prefill_urls) + list(decode_urls):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return JSONResponse({"unhealthy": url}, status_code=503)
            except httpx.HTTPError:
                return JSONResponse({"unreachable": url}, status_code=503)
        return {"status": "ok"}

    return app


class _Upstream(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body
