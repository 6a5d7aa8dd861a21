"""Send requests at their (scaled) trace times and collect per-request results."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .client import RequestResult, stream_completion
from .prompts import PromptBuilder
from .trace import TraceRequest


@dataclass(frozen=True)
class RunConfig:
    url: str                      # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None
    time_scale: float = 1.0       # multiplies trace timestamps (0.5 = twice the rate)
    request_timeout: float = 300.0
    max_concurrency: int = 256    # connections kept by the client
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.time_scale < 0 or self.request_timeout <= 0 or self.max_concurrency < 1:
            raise ValueError("time_scale >= 0, request_timeout > 0, max_concurrency >= 1")


async def _run(requests: list[TraceRequest], prompts: PromptBuilder, cfg: RunConfig,
               on_done=None) -> list[RequestResult]:
    import httpx

    url = cfg.url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout) as client:
        t_start = time.perf_counter()

        async def one(i: int, req: TraceRequest) -> RequestResult:
            due = req.timestamp_ms / 1e3 * cfg.time_scale
            res = RequestResult(index=i, scheduled_s=due)
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - t_start)))
            body = {"prompt": prompts.prompt(req), "max_tokens": prompts.max_tokens(req),
                    "temperature": cfg.temperature, "seed": cfg.seed + i, "ignore_eos": True}
            if cfg.model:
                body["model"] = cfg.model
            res.input_words = prompts.num_words(req)
            res.max_tokens = body["max_tokens"]
            res.sent_s = time.perf_counter() - t_start
            try:  # a total bound: httpx's timeout is per read, a trickling stream never trips it
                await asyncio.wait_for(stream_completion(client, url, body, res, timeout=cfg.request_timeout),
                                       cfg.request_timeout)
            except asyncio.TimeoutError:
                res.error = f"timeout after {cfg.request_timeout}s"
            if on_done is not None:
                on_done()
            return res

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return list(results)


def run(requests: list[TraceRequest], prompts: PromptBuilder, cfg: RunConfig, on_done=None) -> list[RequestResult]:
    """Replay ``requests``; every request ends with a result (errors recorded, never hung:
    each request has ``cfg.request_timeout``)."""
    return asyncio.run(_run(requests, prompts, cfg, on_done))
