"""Serving metrics over a run's per-request records (``RequestResult.as_dict()``).

All latencies are reported in milliseconds. TTFT: send to first text chunk.
TPOT: (e2e - TTFT) / (output tokens - 1). ITL: gaps between consecutive text
chunks, pooled over requests. Goodput: requests per second that completed and
met both SLOs (a one-token answer has no TPOT and meets the TPOT SLO). KV share:
each request's reported KV transfer time divided by its TTFT.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..report.stats import summarize


def parse_pair(text: str, option: str, form: str) -> tuple[float, float]:
    """``"a,b"`` -> ``(a, b)`` as floats; ValueError naming ``option`` and its ``form``."""
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError as exc:
        raise ValueError(f"{option} wants '{form}', got {text!r}") from exc
    return a, b


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """``"ttft_ms,tpot_ms"``, e.g. ``"2000,100"``."""
        ttft, tpot = parse_pair(text, "--slo", "ttft_ms,tpot_ms")
        if ttft <= 0 or tpot <= 0:
            raise ValueError("SLO values must be positive")
        return cls(ttft, tpot)

    def met(self, rec: dict) -> bool:
        if not rec.get("ok"):
            return False
        tpot = rec.get("tpot_s")
        return rec["ttft_s"] * 1e3 <= self.ttft_ms and (tpot is None or tpot * 1e3 <= self.tpot_ms)


def _ms(values):
    return summarize([v * 1e3 for v in values if v is not None]).as_dict()


def itl_values(records: list[dict]) -> list[float]:
    out = []
    for r in records:
        t = r.get("chunk_times_s") or []
        out.extend(b - a for a, b in zip(t, t[1:]))
    return out


def kv_share(records: list[dict]) -> list[float]:
    """Per request: reported KV transfer ms / TTFT ms (requests reporting both)."""
    return [r["kv_transfer_ms"] / (r["ttft_s"] * 1e3) for r in records
            if r.get("ok") and r.get("kv_transfer_ms") is not None and r["ttft_s"] > 0]


def summarize_run(records: list[dict], slo: SLO | None = None) -> dict:
    ok = [r for r in records if r.get("ok")]
    if ok:
        start = min(r["sent_s"] for r in records)
        end = max(r["sent_s"] + r["e2e_s"] for r in ok)
        duration = max(end - start, 1e-9)
    else:
        duration = float("nan")
    out_tokens = sum(r["output_tokens"] for r in ok)
    summary = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "ttft_ms": _ms(r["ttft_s"] for r in ok),
        "tpot_ms": _ms(r.get("tpot_s") for r in ok),
        "itl_ms": _ms(itl_values(ok)),
        "e2e_ms": _ms(r["e2e_s"] for r in ok),
        "kv_transfer_ms": summarize(r["kv_transfer_ms"] for r in ok
                                    if r.get("kv_transfer_ms") is not None).as_dict(),
        "kv_share_of_ttft_pct": summarize(100.0 * s for s in kv_share(ok)).as_dict(),
    }
    if slo is not None:
        good = sum(1 for r in records if slo.met(r))
        summary["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
        summary["goodput"] = good / duration
        summary["slo_attainment"] = good / len(records) if records else float("nan")
    return summary
