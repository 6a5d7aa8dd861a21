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

Layer by layer: once a P answered with ``"layerwise": true`` (its ``remote_ranks``
are remembered per P), the proxy sends each later request to that P and to D at
the same time, naming a fresh ``transfer_id`` in both; D posts its recv while P is
still prefilling, so P's ``save_kv_layer`` streams each layer to D as it is written.
If P's request fails, D's request is closed (vLLM aborts it).

Example::

    app = make_app(["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"])
"""
# no `from __future__ import annotations`: FastAPI must see the real Request class in signatures

import asyncio
import contextlib
import itertools
import json
import uuid

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
    layerwise: dict = {}  # P url -> its ranks' params, while it answers "layerwise": true

    async def prefill(p_url: str, path: str, body: dict, transfer_id: str | None = None) -> dict:
        params = {"do_remote_decode": True, "do_remote_prefill": False}
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
        req = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
        req.pop("stream_options", None)
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        r = await client.post(p_url + path, json=req)
        if r.status_code != 200:
            layerwise.pop(p_url, None)
            raise _Upstream(r.status_code, r.content)
        params = r.json().get("kv_transfer_params")
        if not params:
            raise _Upstream(502, json.dumps({"error": "prefill instance returned no kv_transfer_params "
                                                      "(is it running KVXferConnector as kv_producer?)"}).encode())
        if params.get("layerwise") and params.get("remote_ranks"):
            layerwise[p_url] = {k: params[k] for k in ("remote_addr", "remote_ranks", "remote_kv_heads")}
        else:
            layerwise.pop(p_url, None)
        return params

    async def relay(path: str, request: Request):
        body = await request.json()
        p_url, d_url = next(p_cycle), next(d_cycle) + path
        ranks = layerwise.get(p_url)
        p_task = None
        if ranks is not None:  # D posts its recv now; P streams each layer into it
            transfer_id = "kvx-" + uuid.uuid4().hex
            p_task = asyncio.ensure_future(prefill(p_url, path, body, transfer_id))
            body["kv_transfer_params"] = dict(ranks, do_remote_prefill=True, do_remote_decode=False,
                                              remote_request_id=transfer_id)
        else:
            try:
                body["kv_transfer_params"] = await prefill(p_url, path, body)
            except _Upstream as exc:
                return Response(exc.body, status_code=exc.status, media_type="application/json")
            except httpx.HTTPError as exc:
                return JSONResponse({"error": f"prefill instance unreachable: {exc}"}, status_code=502)
        if not body.get("stream"):
            d_task = asyncio.ensure_future(client.post(d_url, json=body))
            failed = await _prefill_failed(p_task, d_task)
            if failed is not None:
                return failed
            try:
                r = await d_task
            except httpx.HTTPError as exc:
                return JSONResponse({"error": f"decode instance unreachable: {exc}"}, status_code=502)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        d_task = asyncio.ensure_future(client.send(client.build_request("POST", d_url, json=body), stream=True))
        failed = await _prefill_failed(p_task, d_task)
        if failed is not None:
            return failed
        upstream = await d_task

        async def chunks():
            watch = None if p_task is None else asyncio.ensure_future(_close_if_failed(p_task, upstream))
            try:
                async for chunk in upstream.aiter_bytes():  # decoded: our response sets its own headers
                    yield chunk
            finally:
                if watch is not None:
                    watch.cancel()
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


async def _prefill_failed(p_task, d_task):
    """Layer by layer, P and D run at once: wait until D answered or P failed; P's
    failure (its response) after closing D's request, else None."""
    from fastapi.responses import JSONResponse, Response

    if p_task is None:
        return None
    await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
    if not p_task.done() or p_task.exception() is None:
        return None
    d_task.cancel()  # closes D's connection: vLLM aborts the request and its recv
    exc = p_task.exception()
    if isinstance(exc, _Upstream):
        return Response(exc.body, status_code=exc.status, media_type="application/json")
    return JSONResponse({"error": f"prefill instance unreachable: {exc}"}, status_code=502)


async def _close_if_failed(p_task, upstream) -> None:
    """Close D's stream if P's request fails while D streams."""
    with contextlib.suppress(Exception):
        await p_task
    if p_task.exception() is not None:
        await upstream.aclose()


class _Upstream(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body
