"""One streamed ``POST /v1/completions`` request, timed token by token.

The client reads the Server-Sent Events stream (``data: {json}`` lines, ending
with ``data: [DONE]``) and stamps every chunk that carries text. The server may
add a ``"kvxfer"`` object to any chunk (normally the last) with the request's
KV transfer: ``{"kv_transfer_ms": float, "kv_bytes": int}`` (``transfer_ms`` is
accepted as an alias); ``usage.completion_tokens`` in the last chunk, when
present, is the authoritative output token count.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    index: int
    scheduled_s: float            # when it should have been sent (trace time, scaled)
    sent_s: float = 0.0           # when it was sent (run clock)
    input_words: int = 0
    max_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each text chunk, from sent_s
    output_tokens: int = 0
    kv_transfer_ms: float | None = None
    kv_bytes: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if not self.ok or self.output_tokens < 2 or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(ok=self.ok, tpot_s=self.tpot_s)
        return d


def _apply_kvxfer(result: RequestResult, info) -> None:
    if not isinstance(info, dict):
        return
    ms = info.get("kv_transfer_ms", info.get("transfer_ms"))
    if isinstance(ms, (int, float)):
        result.kv_transfer_ms = float(ms)
    if isinstance(info.get("kv_bytes"), int):
        result.kv_bytes = info["kv_bytes"]


def handle_event(result: RequestResult, data: str, t_rel: float) -> bool:
    """Apply one SSE ``data:`` payload; return True at ``[DONE]``."""
    if data.strip() == "[DONE]":
        return True
    obj = json.loads(data)
    if "error" in obj:
        raise RuntimeError(f"server error: {obj['error']}")
    for choice in obj.get("choices") or ():
        if choice.get("text"):
            if result.ttft_s is None:
                result.ttft_s = t_rel
            result.chunk_times_s.append(t_rel)
    if "kvxfer" in obj:
        _apply_kvxfer(result, obj["kvxfer"])
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = usage["completion_tokens"]
    return False


async def stream_completion(client, url: str, body: dict, result: RequestResult, *,
                            timeout: float) -> RequestResult:
    """Send ``body`` to ``url`` with ``stream=true``; fill ``result`` (errors recorded, not raised)."""
    import httpx

    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json={**body, "stream": True}, timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {resp.status_code}: {text}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # comments, event names, keep-alives, blank separators
                if handle_event(result, line[5:].strip(), time.perf_counter() - t0):
                    break
        result.e2e_s = time.perf_counter() - t0
        if result.output_tokens == 0:
            result.output_tokens = len(result.chunk_times_s)
        if result.ttft_s is None:
            result.error = "stream ended without any text"
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
