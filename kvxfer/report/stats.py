"""Summary statistics over benchmark iterations.

Warm-up iterations are dropped by the caller *before* they reach :func:`summarize`
(the runners record them separately), so every figure here is steady state.
Percentiles use linear interpolation between order statistics (numpy's default),
which is what nixlbench and ``triton.testing.do_bench`` report.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Summary:
    """Statistics of one measured quantity; the unit is the caller's (µs, s, GB/s)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> Summary:
    """Mean, median, p90, p99, min and max of ``values`` (NaNs everywhere when empty)."""
    data = [float(v) for v in values]
    if not data:
        nan = math.nan
        return Summary(0, nan, nan, nan, nan, nan, nan)
    return Summary(
        count=len(data),
        mean=sum(data) / len(data),
        median=percentile(data, 50),
        p90=percentile(data, 90),
        p99=percentile(data, 99),
        min=min(data),
        max=max(data),
    )


def gbps(num_bytes: float, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second), the unit nixlbench and ucx_perftest print as GB/s."""
    if seconds <= 0:
        return math.inf if num_bytes > 0 else 0.0
    return num_bytes / seconds / 1e9
