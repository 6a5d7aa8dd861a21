"""The SLO from single-request latencies, measured before the run.

A server's TTFT and TPOT with nothing else running are the floor any SLO must
sit above. :func:`measure_single` sends one representative request at a time
(the median-length prompt of the run, its median output length) and
:func:`choose_slo` multiplies the median TTFT and TPOT of those by stated
factors (default 3x TTFT, 2x TPOT: room for queueing and batching, none for a
server that stalls decodes behind prompts).
"""
from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass

from .client import RequestResult, stream_completion
from .metrics import SLO, parse_pair
from .prompts import PromptBuilder
from .trace import TraceRequest

DEFAULT_FACTORS = (3.0, 2.0)


@dataclass(frozen=True)
class Calibration:
    """Median single-request latencies (ms) and the SLO chosen from them."""

    prompt_words: int
    max_tokens: int
    ttft_ms: float
    tpot_ms: float
    factors: tuple[float, float]
    slo: SLO

    def as_dict(self) -> dict:
        return {"prompt_words": self.prompt_words, "max_tokens": self.max_tokens,
                "single_ttft_ms": self.ttft_ms, "single_tpot_ms": self.tpot_ms,
                "factors": list(self.factors),
                "slo": {"ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms}}


def parse_factors(text: str) -> tuple[float, float]:
    """``"3,2"`` -> ``(3.0, 2.0)`` (TTFT factor, TPOT factor), both > 1."""
    ttft, tpot = parse_pair(text, "--slo-factors", "ttft_x,tpot_x")
    if ttft <= 1 or tpot <= 1:
        raise ValueError("SLO factors must be > 1 (an SLO below single-request latency is unmeetable)")
    return ttft, tpot


def representative(requests: list[TraceRequest]) -> TraceRequest:
    """The request of median input length (output length: the median over all)."""
    if not requests:
        raise ValueError("no requests to calibrate on")
    by_len = sorted(requests, key=lambda r: r.input_length)
    mid = by_len[len(by_len) // 2]
    out = round(statistics.median(r.output_length for r in requests))
    return TraceRequest(0.0, mid.input_length, max(2, out), mid.hash_ids)


async def _measure(url: str, bodies: list[dict], timeout: float) -> list[RequestResult]:
    import httpx

    results = []
    async with httpx.AsyncClient(timeout=timeout) as client:
        for i, body in enumerate(bodies):  # one at a time: nothing else on the server
            res = RequestResult(index=i, scheduled_s=0.0)
            try:
                await asyncio.wait_for(stream_completion(client, url, body, res, timeout=timeout),
                                       timeout)
            except asyncio.TimeoutError:
                res.error = f"timeout after {timeout}s"
            results.append(res)
    return results


def measure_single(url: str, request: TraceRequest, prompts: PromptBuilder, *, repeats: int = 3,
                   model: str | None = None, timeout: float = 300.0,
                   factors: tuple[float, float] = DEFAULT_FACTORS) -> Calibration:
    """Send ``request`` ``repeats`` times, one after the other; the SLO from the medians.

    Raises RuntimeError when a request fails (no SLO from a broken server).
    Each repeat uses a fresh prompt seed so prefix caching does not shorten the prefill.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    bodies = []
    for i in range(repeats):
        fresh = PromptBuilder(length_scale=prompts.length_scale, seed=prompts.seed + 1000 + i,
                              output_scale=prompts.output_scale)
        body = {"prompt": fresh.prompt(request), "max_tokens": max(2, prompts.max_tokens(request)),
                "temperature": 0.0, "ignore_eos": True}
        if model:
            body["model"] = model
        bodies.append(body)
    url = url.rstrip("/") + "/v1/completions"
    results = asyncio.run(_measure(url, bodies, timeout))
    bad = [r for r in results if not r.ok or r.tpot_s is None]
    if bad:
        raise RuntimeError(f"calibration request failed: {bad[0].error or 'fewer than 2 tokens'}")
    ttft = statistics.median(r.ttft_s for r in results) * 1e3
    tpot = statistics.median(r.tpot_s for r in results) * 1e3
    slo = SLO(round(ttft * factors[0]), round(tpot * factors[1]))
    return Calibration(prompts.num_words(request), max(2, prompts.max_tokens(request)), ttft, tpot,
                       factors, slo)
