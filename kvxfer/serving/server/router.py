"""The OpenAI-compatible router: FastAPI app over a :class:`Dispatcher`.

``create_app(config)`` returns an app whose lifespan starts the workers and
stops (drains) them; run it with uvicorn (``kvxfer serve``). The router
tokenizes, applies the chat template, detokenizes and checks stop strings;
the workers only see token ids.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
true: SSE ``data: {...}`` chunks then ``data: [DONE]``), ``GET /health``,
``GET /metrics`` (Prometheus text), ``GET /v1/models``. What a request may ask
(and what is refused with a 400 naming the parameter): :mod:`kvxfer.serving.server.api`.
A request with ``n`` choices or a list of prompts becomes one dispatcher
request per choice, streamed interleaved (each chunk carries its ``index``).
Bearer-token check, body limit and deadline, error bodies:
:mod:`kvxfer.serving.server.guard`. Tokenization runs on
a small thread pool (the tokenizer releases the GIL), never on the event loop,
so a large prompt does not hold up ``/health`` or other requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from . import api
from .guard import HTTPGuard, install_error_handlers
from .dispatch import Dispatcher, NoWorkerAvailable, RequestState
from .prom import Registry, WorkerSeries
from .serve_config import ServeConfig
from .sse import DONE, event

log = logging.getLogger("kvxfer.serve")

SETTLE_TIMEOUT_S = 5.0  # wait for the prefill side's transfer report after the last token
TOKENIZER_THREADS = 2


class RequestFailed(Exception):
    def __init__(self, message: str, kind: str, status: int = 500, param: str | None = None):
        super().__init__(message)
        self.kind, self.status, self.param = kind, status, param


@dataclass
class Choice:
    """One generated answer of a request: choice ``index`` of prompt ``prompt_ids``."""

    index: int
    rid: str  # the dispatcher's request id of this choice
    prompt_ids: list[int]
    params: dict
    state: RequestState | None = None
    pool_hit_blocks: int = 0  # leading prompt blocks the KV pool held when it was routed


class _Batch:
    """What the choices of one HTTP request share: how a choice closed early counts."""

    def __init__(self) -> None:
        self.abort_outcome = "aborted"  # the client went away, unless a sibling failed


class Router:
    """Tokenization, worker dispatch and response assembly for one server."""

    def __init__(self, config: ServeConfig):
        from .text import TextCodec

        self.config = config
        self.registry = Registry()
        self.dispatcher = Dispatcher(config, self.registry)
        self.codec = TextCodec.load(config.model_path)
        self.model_name = self.codec.model_name
        # the context limit is the served model's; the simulated engine serves a cost profile
        # over token ids, bounded by the KV pool only (as kvxfer simulate's virtual clock)
        self.max_position = 0 if config.engine == "sim" else self.codec.max_position
        self.logprobs = api.LogprobFormatter(self.codec.tokenizer)
        self.dispatcher.cluster.model_name = self.model_name  # discovery: pair only this model
        self.m_workers = WorkerSeries(self.registry)
        self.m_role_workers = self.registry.gauge("kvxfer_workers", "Live workers per role.", ("role",))
        self.rebalancer = None
        if config.adaptive is not None:
            from .rebalancer import Rebalancer

            self.rebalancer = Rebalancer(self.dispatcher, self.registry, config.adaptive,
                                         config.adaptive_slo_ms)
        self._pool_tokens = 0  # a worker's KV pool in tokens, from its ready message
        from .pool_lookup import PoolLookup

        self.pool = PoolLookup.open(config, self.dispatcher.cluster.routing.block_size)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a text prompt or a chat, computed off the event loop."""
        loop = asyncio.get_running_loop()
        if messages is not None:
            return await loop.run_in_executor(self._tokenize_pool, self.codec.encode_chat, messages)
        return await loop.run_in_executor(self._tokenize_pool, self.codec.encode, prompt)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None:
            self.pool.close()

    async def look_up_pool(self, choices: list[Choice]) -> None:
        """Each choice's ``pool_hit_blocks`` (:mod:`.pool_lookup`; one lookup a prompt),
        when the server has a pool the router weighs."""
        if self.pool is None:
            return
        info = next((w.info for w in self.dispatcher.cluster.role("prefill")
                     if w.is_alive and self.pool.salt(w.info) is not None), None)
        found: dict[int, int] = {}
        for c in choices:
            key = id(c.prompt_ids)
            if key not in found:
                found[key] = await self.pool.hits(c.prompt_ids, info)
            c.pool_hit_blocks = found[key]

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (None: the served one)."""
        if model is not None and model != self.model_name:
            raise RequestFailed(f"The model `{model}` does not exist (this server serves "
                                f"`{self.model_name}`)", "invalid_request_error", 404, "model")

    def choices(self, rid: str, prompts: list[list[int]], req: api._SamplingFields) -> list[Choice]:
        """``req.n`` choices per prompt (index ``prompt * n + i``, as vLLM numbers them),
        each checked against the context length and the KV pool; nothing is submitted."""
        if len(prompts) * req.n > api.MAX_CHOICES:
            raise RequestFailed(f"{len(prompts)} prompts x n={req.n} exceeds {api.MAX_CHOICES} "
                                "choices per request", "invalid_request_error", 400, "n")
        out = []
        for p, prompt_ids in enumerate(prompts):
            self._check_length(prompt_ids, req.num_tokens)
            for i in range(req.n):
                index = p * req.n + i
                choice_rid = rid if len(prompts) * req.n == 1 else f"{rid}.{index}"
                out.append(Choice(index, choice_rid, prompt_ids,
                                  req.sampling(self.codec.stop_token_ids, i)))
        return out

    def submit(self, choices: list[Choice]) -> None:
        """Hand every choice to the workers; 503 (and nothing left running) when one cannot be."""
        for c in choices:
            try:
                c.state = self.dispatcher.submit(c.rid, c.prompt_ids, c.params,
                                                 pool_hit_blocks=c.pool_hit_blocks)
            except NoWorkerAvailable as exc:
                for done in choices:
                    if done.state is not None:
                        self.dispatcher.abort(done.rid, outcome="error")
                raise RequestFailed(str(exc), "unavailable", 503) from None

    async def generate(self, choice: Choice, stop: list[str], batch: _Batch) -> AsyncIterator[tuple]:
        """Yield ``("delta", text, tokens)`` ... then ``("final", reason, usage, summary, token_ids,
        tokens)`` for a submitted choice; ``tokens``: ``[(token_id, logprobs report)]`` of the
        tokens since the previous item, when the request asked for logprobs.

        Raises :class:`RequestFailed`; aborts the workers' share if the caller
        stops iterating early (client disconnected, or a sibling choice failed).
        """
        from ..model.detokenize import IncrementalDetokenizer

        rid, st = choice.rid, choice.state
        detok = IncrementalDetokenizer(self.codec.tokenizer, stop)
        token_ids: list[int] = []
        pending: list[tuple[int, dict]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(st.events.get(), deadline - loop.time())
                except asyncio.TimeoutError:
                    self.dispatcher.abort(rid, outcome="timeout")
                    raise RequestFailed(f"request {rid}: no answer within "
                                        f"{self.config.request_timeout_s:.0f} s", "timeout", 504) from None
                if item[0] == "error":
                    raise RequestFailed(f"request {rid}: {item[1]}", item[2], 500)
                if item[0] == "token":
                    token_ids.append(item[1])
                    if item[2] is not None:
                        pending.append((item[1], item[2]))
                    delta = detok.update(token_ids)
                    if delta:
                        yield ("delta", delta, pending)
                        pending = []
                    if detok.stopped:  # a stop string: the workers' share is dropped
                        self.dispatcher.abort(rid, outcome="ok")
                        reason = "stop"
                        break
                else:  # ("done", reason)
                    reason = item[1]
                    tail = detok.update(token_ids, final=True)
                    if tail:
                        yield ("delta", tail, pending)
                        pending = []
                    break
            finished = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(st.transfer_settled.wait(), SETTLE_TIMEOUT_S)
            self.dispatcher.record(st, len(token_ids))
            usage = {"prompt_tokens": len(choice.prompt_ids), "completion_tokens": len(token_ids),
                     "total_tokens": len(choice.prompt_ids) + len(token_ids)}
            yield ("final", reason, usage, st.summary(), token_ids, pending)
        finally:
            if not finished:
                self.dispatcher.abort(rid, outcome=batch.abort_outcome)

    def _check_length(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise RequestFailed("empty prompt", "invalid_request_error", 400)
        vocab = self.codec.tokenizer.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestFailed(f"token ids must lie in [0, {vocab})", "invalid_request_error", 400)
        pools = [w.info.get("num_blocks", 0) * w.info.get("block_size", 0)  # a restarting
                 for w in self.dispatcher.cluster.workers if w.info]  # worker has no info yet
        if pools:  # the smallest: workers of other TP degrees hold other amounts
            self._pool_tokens = min(pools)
        pool_tokens = self._pool_tokens  # 0 until a worker reported: submit() then says 503
        for limit, what in ((self.max_position, "the context length"),
                            (pool_tokens, "a worker's KV pool")):
            if limit and len(prompt_ids) + max_tokens > limit:  # 0: no worker seen yet
                raise RequestFailed(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                                    f"exceeds {what} ({limit} tokens)", "invalid_request_error", 400)

    async def metrics_text(self) -> str:
        roles = dict.fromkeys(("prefill", "decode") if self.config.is_disaggregated
                              else ("colocated",), 0)
        for w in self.dispatcher.cluster.workers:
            self.m_workers.seen(w.name, w.is_alive, w.load)
            if w.is_alive and w.role in roles:
                roles[w.role] += 1
        for role, n in roles.items():
            self.m_role_workers.set(n, role=role)
        stats = await self.dispatcher.collect_stats()
        for name, msg in stats.items():
            self.m_workers.report(name, msg.get("counters", {}), msg.get("info", {}))
        self.m_workers.keep(w.name for w in self.dispatcher.cluster.workers)
        return self.registry.render()


def _error_response(exc: RequestFailed) -> JSONResponse:
    return JSONResponse(api.error_body(str(exc), exc.kind, exc.status, exc.param),
                        status_code=exc.status)


async def _merged(router: Router, choices: list[Choice], stop: list[str]) -> AsyncIterator[tuple]:
    """``(choice, item)`` of every choice's :meth:`Router.generate` as they come.

    The first :class:`RequestFailed` of any choice is raised after the others
    were aborted (counted as errors, not client aborts); closing this
    generator early aborts every choice still running.
    """
    batch = _Batch()
    gens = [router.generate(c, stop, batch) for c in choices]
    if len(gens) == 1:  # no tasks for the common case
        try:
            async for item in gens[0]:
                yield choices[0], item
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice, gen) -> None:
        try:
            async for item in gen:
                await queue.put((choice, item))
        except RequestFailed as exc:
            await queue.put((choice, exc))
        finally:
            await queue.put((choice, None))

    tasks = [asyncio.create_task(pump(c, g)) for c, g in zip(choices, gens)]
    try:
        remaining = len(tasks)
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, RequestFailed):
                batch.abort_outcome = "error"
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()


async def _respond(router: Router, req: api._SamplingFields, prompts: list[list[int]],
                   is_chat: bool):
    rid = router.dispatcher.new_rid("chatcmpl" if is_chat else "cmpl")
    created, model = api.now(), router.model_name
    try:
        choices = router.choices(rid, prompts, req)
        await router.look_up_pool(choices)
        router.submit(choices)
    except RequestFailed as exc:
        return _error_response(exc)
    want_logprobs = req.num_logprobs is not None
    offsets = {c.index: 0 for c in choices}  # completions: text_offset of the next token

    def logprobs(choice: Choice, tokens: list) -> dict | None:
        if not want_logprobs:
            return None
        if is_chat:
            return router.logprobs.chat(tokens)
        body, offsets[choice.index] = router.logprobs.completion(tokens, offsets[choice.index])
        return body

    def total_usage(usages: list[dict]) -> dict:
        prompt = sum(len(p) for p in prompts)  # each prompt counted once, as vLLM does
        completion = sum(u["completion_tokens"] for u in usages)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    events = _merged(router, choices, req.stop)
    if not req.stream:
        texts = {c.index: [] for c in choices}
        tokens = {c.index: [] for c in choices}
        finals = {}
        try:
            async for choice, item in events:
                if item[0] == "delta":
                    texts[choice.index].append(item[1])
                    tokens[choice.index] += item[2]
                else:
                    finals[choice.index] = item
                    tokens[choice.index] += item[5]
        except RequestFailed as exc:
            return _error_response(exc)
        body_choices, summaries, usages = [], [], []
        for c in choices:
            _, reason, usage, summary, token_ids, _ = finals[c.index]
            summary["token_ids"] = token_ids  # non-streaming only: lets clients check equality
            text, lp = "".join(texts[c.index]), logprobs(c, tokens[c.index])
            if is_chat:
                body_choices.append(api.chat_choice(c.index, reason, lp, message={
                    "role": "assistant", "content": text}))
            else:
                body_choices.append(api.completion_choice(c.index, text, reason, lp))
            summaries.append(summary)
            usages.append(usage)
        extra = dict(summaries[0])
        if len(summaries) > 1:
            extra["choices"] = summaries
        body = {**api.envelope(rid, "chat.completion" if is_chat else "text_completion",
                               model, created),
                "choices": body_choices, "usage": total_usage(usages), "kvxfer": extra}
        return JSONResponse(body)

    # Validate and submit before the 200 goes out, so early failures keep their status.
    try:
        first = await events.__anext__()
    except RequestFailed as exc:
        await events.aclose()
        return _error_response(exc)
    except StopAsyncIteration:  # cannot happen: every choice ends with a final item
        return _error_response(RequestFailed("no output", "server_error", 500))
    kind = "chat.completion.chunk" if is_chat else "text_completion"
    include_usage = req.stream_options is not None and req.stream_options.include_usage

    def chunk(choice: Choice, delta: str | None, reason: str | None, tokens: list) -> dict:
        lp = logprobs(choice, tokens) if tokens or reason is not None else None
        if is_chat:
            c = api.chat_choice(choice.index, reason, lp,
                                delta={} if delta is None else {"content": delta})
        else:
            c = api.completion_choice(choice.index, delta or "", reason, lp)
        return {**api.envelope(rid, kind, model, created), "choices": [c]}

    async def body() -> AsyncIterator[str]:
        if is_chat:
            for c in choices:
                start = api.chat_choice(c.index, None, None, delta={"role": "assistant",
                                                                    "content": ""})
                yield event({**api.envelope(rid, kind, model, created), "choices": [start]})
        usages = []
        item = first
        try:
            while True:
                choice, ev = item
                if ev[0] == "delta":
                    yield event(chunk(choice, ev[1], None, ev[2]))
                else:
                    _, reason, usage, summary, _, tokens = ev
                    final = chunk(choice, None, reason, tokens)
                    final["usage"], final["kvxfer"] = usage, summary
                    usages.append(usage)
                    yield event(final)
                try:
                    item = await events.__anext__()
                except StopAsyncIteration:
                    break
            if include_usage:
                yield event({**api.envelope(rid, kind, model, created), "choices": [],
                             "usage": total_usage(usages)})
        except RequestFailed as exc:
            yield event(api.error_body(str(exc), exc.kind, exc.status, exc.param))
        finally:
            await events.aclose()
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
    app.add_middleware(HTTPGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout_s=config.body_timeout_s, max_inflight=config.limit_concurrency)

    def admit(router: Router, req: api._SamplingFields) -> None:
        router.check_model(req.model)
        try:
            req.check_supported()
        except api.Unsupported as exc:
            raise RequestFailed(str(exc), "invalid_request_error", 400, exc.param) from None

    @app.post("/v1/completions")
    async def completions(req: api.CompletionRequest):
        router: Router = state["router"]
        admit(router, req)
        prompts = [list(p) if isinstance(p, list) else await router.encode(p)
                   for p in req.prompts()]
        return await _respond(router, req, prompts, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: api.ChatRequest):
        router: Router = state["router"]
        admit(router, req)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        return await _respond(router, req, [await router.encode(messages=messages)], is_chat=True)

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
