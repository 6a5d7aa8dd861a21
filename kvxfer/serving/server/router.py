"""The OpenAI-compatible router: FastAPI app over a :class:`Dispatcher`.

``create_app(config)`` returns an app whose lifespan starts the workers and
stops (drains) them; run it with uvicorn (``kvxfer serve``). The router
tokenizes, applies the chat template, detokenizes and checks stop strings;
the workers only see token ids.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
true: SSE ``data: {...}`` chunks then ``data: [DONE]``), ``GET /health``,
``GET /metrics`` (Prometheus text), ``GET /v1/models``. Bearer-token check,
body limit and error bodies: :mod:`kvxfer.serving.server.guard`. Tokenization runs on
a small thread pool (the tokenizer releases the GIL), never on the event loop,
so a large prompt does not hold up ``/health`` or other requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from . import api
from .guard import HTTPGuard, install_error_handlers
from .dispatch import Dispatcher, NoWorkerAvailable, RequestState
from .prom import Registry
from .serve_config import ServeConfig
from .sse import DONE, event

log = logging.getLogger("kvxfer.serve")

SETTLE_TIMEOUT_S = 5.0  # wait for the prefill side's transfer report after the last token
TOKENIZER_THREADS = 2


class RequestFailed(Exception):
    def __init__(self, message: str, kind: str, status: int = 500):
        super().__init__(message)
        self.kind, self.status = kind, status


class Router:
    """Tokenization, worker dispatch and response assembly for one server."""

    def __init__(self, config: ServeConfig):
        from .text import TextCodec

        self.config = config
        self.registry = Registry()
        self.dispatcher = Dispatcher(config, self.registry)
        self.codec = TextCodec.load(config.model_path)
        self.model_name = self.codec.model_name
        self.dispatcher.cluster.model_name = self.model_name  # discovery: pair only this model
        self.m_workers_up = self.registry.gauge("kvxfer_worker_up", "1 if the worker process is alive.", ("worker",))
        self.m_queue = self.registry.gauge("kvxfer_worker_inflight", "Requests held by each worker (queue depth).", ("worker",))
        self.m_worker = self.registry.gauge("kvxfer_worker_stat", "Counters reported by each worker and its agent.", ("worker", "stat"))
        self.m_agent_info = self.registry.gauge("kvxfer_agent_info", "Agent facts: backend, transport selected per peer.", ("worker", "key", "value"))
        self.m_role_workers = self.registry.gauge("kvxfer_workers", "Live workers per role.", ("role",))
        self.rebalancer = None
        if config.adaptive is not None:
            from .rebalancer import Rebalancer

            self.rebalancer = Rebalancer(self.dispatcher, self.registry, config.adaptive,
                                         config.adaptive_slo_ms)
        self._pool_tokens = 0  # a worker's KV pool in tokens, from its ready message
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a text prompt or a chat, computed off the event loop."""
        loop = asyncio.get_running_loop()
        if messages is not None:
            return await loop.run_in_executor(self._tokenize_pool, self.codec.encode_chat, messages)
        return await loop.run_in_executor(self._tokenize_pool, self.codec.encode, prompt)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def generate(self, prompt_ids: list[int], req: api._SamplingFields,
                       rid: str) -> AsyncIterator[tuple]:
        """Yield ``("delta", text)`` ... then ``("final", reason, usage, summary, token_ids)``.

        Raises :class:`RequestFailed`; aborts the workers' share if the caller
        stops iterating early (client disconnected).
        """
        self._check_length(prompt_ids, req.max_tokens)
        params = req.sampling(self.codec.stop_token_ids)
        try:
            st = self.dispatcher.submit(rid, prompt_ids, params)
        except NoWorkerAvailable as exc:
            raise RequestFailed(str(exc), "unavailable", 503) from None
        from ..model.detokenize import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.codec.tokenizer, req.stop)
        token_ids: list[int] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(st.events.get(), deadline - loop.time())
                except asyncio.TimeoutError:
                    raise RequestFailed(f"no answer within {self.config.request_timeout_s:.0f}s",
                                        "timeout", 504) from None
                if item[0] == "error":
                    raise RequestFailed(item[1], item[2], 500)
                if item[0] == "token":
                    token_ids.append(item[1])
                    delta = detok.update(token_ids)
                    if delta:
                        yield ("delta", delta)
                    if detok.stopped:  # a stop string: the workers' share is dropped
                        self.dispatcher.abort(rid)
                        self.dispatcher.m_requests.inc(outcome="ok")
                        reason = "stop"
                        break
                else:  # ("done", reason)
                    reason = item[1]
                    tail = detok.update(token_ids, final=True)
                    if tail:
                        yield ("delta", tail)
                    break
            finished = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(st.transfer_settled.wait(), SETTLE_TIMEOUT_S)
            self.dispatcher.record(st, len(token_ids))
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
                     "total_tokens": len(prompt_ids) + len(token_ids)}
            yield ("final", reason, usage, st.summary(), token_ids)
        finally:
            if not finished:
                self.dispatcher.abort(rid)

    def _check_length(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise RequestFailed("empty prompt", "invalid_request_error", 400)
        vocab = self.codec.tokenizer.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestFailed(f"token ids must lie in [0, {vocab})", "invalid_request_error", 400)
        for w in self.dispatcher.cluster.workers:  # a restarting worker has no info yet
            if w.info:
                self._pool_tokens = w.info.get("num_blocks", 0) * w.info.get("block_size", 0)
                break
        pool_tokens = self._pool_tokens  # 0 until a worker reported: submit() then says 503
        for limit, what in ((self.codec.max_position, "the context length"),
                            (pool_tokens, "a worker's KV pool")):
            if limit and len(prompt_ids) + max_tokens > limit:  # 0: no worker seen yet
                raise RequestFailed(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                                    f"exceeds {what} ({limit} tokens)", "invalid_request_error", 400)

    async def metrics_text(self) -> str:
        roles = dict.fromkeys(("prefill", "decode") if self.config.is_disaggregated
                              else ("colocated",), 0)
        for w in self.dispatcher.cluster.workers:
            self.m_workers_up.set(1 if w.is_alive else 0, worker=w.name)
            self.m_queue.set(w.load, worker=w.name)
            if w.is_alive and w.role in roles:
                roles[w.role] += 1
        for role, n in roles.items():
            self.m_role_workers.set(n, role=role)
        stats = await self.dispatcher.collect_stats()
        for name, msg in stats.items():
            for key, value in msg.get("counters", {}).items():
                self.m_worker.set(value, worker=name, stat=key)
            for key, value in msg.get("info", {}).items():
                self.m_agent_info.set(1, worker=name, key=key, value=str(value))
        return self.registry.render()


def _error_response(exc: RequestFailed) -> JSONResponse:
    return JSONResponse(api.error_body(str(exc), exc.kind, exc.status), status_code=exc.status)


async def _respond(router: Router, req: api._SamplingFields, prompt_ids: list[int], is_chat: bool):
    rid = router.dispatcher.new_rid("chatcmpl" if is_chat else "cmpl")
    created, model = api.now(), router.model_name
    gen = router.generate(prompt_ids, req, rid)
    if not req.stream:
        parts = []
        try:
            async for item in gen:
                if item[0] == "delta":
                    parts.append(item[1])
                else:
                    _, reason, usage, summary, token_ids = item
        except RequestFailed as exc:
            return _error_response(exc)
        summary["token_ids"] = token_ids  # non-streaming only: lets clients check equality
        build = api.chat_body if is_chat else api.completion_body
        return JSONResponse(build(rid, model, created, "".join(parts), reason, usage, summary))

    # Validate and submit before the 200 goes out, so early failures keep their status.
    try:
        first = await gen.__anext__()
    except RequestFailed as exc:
        return _error_response(exc)

    def chunk(delta: str | None, reason: str | None) -> dict:
        if is_chat:
            return api.chat_chunk(rid, model, created, {} if delta is None else {"content": delta}, reason)
        return api.completion_chunk(rid, model, created, delta or "", reason)

    async def body() -> AsyncIterator[str]:
        if is_chat:
            yield event(api.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
        item = first
        try:
            while True:
                if item[0] == "delta":
                    yield event(chunk(item[1], None))
                else:
                    _, reason, usage, summary, _ = item
                    final = chunk(None, reason)
                    final["usage"], final["kvxfer"] = usage, summary
                    yield event(final)
                    break
                item = await gen.__anext__()
        except RequestFailed as exc:
            yield event(api.error_body(str(exc), exc.kind, exc.status))
        finally:
            await gen.aclose()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def create_app(config: ServeConfig) -> FastAPI:
    """The router app; its lifespan starts and drains the workers."""
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router = await asyncio.to_thread(Router, config)
        await router.dispatcher.cluster.start()
        if router.rebalancer is not None:
            router.rebalancer.start()
        state["router"] = router
        log.info("serving %s (%s)", router.model_name,
                 "disaggregated" if config.is_disaggregated else "colocated")
        try:
            yield
        finally:
            if router.rebalancer is not None:
                await router.rebalancer.stop()
            await router.dispatcher.cluster.stop()
            router.close()

    app = FastAPI(title="kvxfer reference server", lifespan=lifespan)
    app.state.router_state = state  # tests may install a Router without the lifespan
    install_error_handlers(app)
    app.add_middleware(HTTPGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    @app.post("/v1/completions")
    async def completions(req: api.CompletionRequest):
        router: Router = state["router"]
        if isinstance(req.prompt, list):
            prompt_ids = [int(t) for t in req.prompt]
        else:
            prompt_ids = await router.encode(req.prompt)
        return await _respond(router, req, prompt_ids, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: api.ChatRequest):
        router: Router = state["router"]
        messages = [m.model_dump() for m in req.messages]
        return await _respond(router, req, await router.encode(messages=messages), is_chat=True)

    @app.get("/health")
    async def health():
        health = state["router"].dispatcher.cluster.health()
        return JSONResponse(health, status_code=200 if health["status"] != "down" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await state["router"].metrics_text(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state["router"].model_name, "object": "model",
                                            "owned_by": "kvxfer"}]}

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, exc: RequestFailed):
        return _error_response(exc)

    return app
