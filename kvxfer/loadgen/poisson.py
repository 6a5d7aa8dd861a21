"""Synthetic requests: Poisson arrivals at a fixed rate, in the trace's own format.

Every request starts with ``shared_blocks`` common hash ids (a shared system
prompt, reused by prefix caching) followed by ids of its own; input and output
lengths are drawn uniformly within ``±spread`` of the given means.

:func:`phased_requests` chains several such streams (``--phases``): a mix that
shifts mid-run, e.g. prompt-heavy then decode-heavy, for adaptive P/D serving.
"""
from __future__ import annotations

import math
import random
from dataclasses import replace

from .trace import BLOCK_TOKENS, TraceRequest


def poisson_requests(*, rate: float, num_requests: int, input_length: int, output_length: int,
                     spread: float = 0.0, shared_blocks: int = 0, seed: int = 0,
                     first_id: int | None = None) -> list[TraceRequest]:
    """``num_requests`` requests with exponential inter-arrival times of mean ``1/rate`` s.

    Own hash ids start at ``first_id`` (default ``shared_blocks``)."""
    if rate <= 0 or num_requests < 1 or input_length < 1 or output_length < 1:
        raise ValueError("rate, num_requests, input_length and output_length must be positive")
    if not 0.0 <= spread < 1.0 or shared_blocks < 0:
        raise ValueError("spread must be in [0, 1) and shared_blocks >= 0")
    rng = random.Random(seed)
    next_id = shared_blocks if first_id is None else max(first_id, shared_blocks)
    t_ms = 0.0
    out = []
    for _ in range(num_requests):
        n_in = max(1, round(input_length * rng.uniform(1 - spread, 1 + spread)))
        n_out = max(1, round(output_length * rng.uniform(1 - spread, 1 + spread)))
        n_blocks = math.ceil(n_in / BLOCK_TOKENS)
        shared = list(range(min(shared_blocks, n_blocks)))
        own = list(range(next_id, next_id + n_blocks - len(shared)))
        next_id += len(own)
        out.append(TraceRequest(t_ms, n_in, n_out, tuple(shared + own)))
        t_ms += rng.expovariate(rate) * 1000.0
    return out


def parse_phases(text: str, rate: float) -> list[tuple[int, int, int, float]]:
    """``"N:IN:OUT[:RATE],..."`` -> ``[(num_requests, input_len, output_len, rate), ...]``."""
    phases = []
    for part in text.split(","):
        fields = part.strip().split(":")
        if len(fields) not in (3, 4):
            raise ValueError(f"bad phase {part!r}: expected N:IN:OUT or N:IN:OUT:RATE")
        try:
            n, n_in, n_out = (int(f) for f in fields[:3])
            r = float(fields[3]) if len(fields) == 4 else rate
        except ValueError:
            raise ValueError(f"bad phase {part!r}: numbers expected") from None
        phases.append((n, n_in, n_out, r))
    return phases


def phased_requests(phases: list[tuple[int, int, int, float]], *, spread: float = 0.0,
                    shared_blocks: int = 0, seed: int = 0) -> list[TraceRequest]:
    """Poisson streams one after the other (each ``(n, input_len, output_len, rate)``);
    the next phase's first request arrives one exponential gap after the last one."""
    if not phases:
        raise ValueError("no phases")
    out: list[TraceRequest] = []
    t0_ms, next_id = 0.0, shared_blocks
    rng = random.Random(seed)
    for i, (n, n_in, n_out, rate) in enumerate(phases):
        part = poisson_requests(rate=rate, num_requests=n, input_length=n_in, output_length=n_out,
                                spread=spread, shared_blocks=shared_blocks, seed=seed + i,
                                first_id=next_id)
        out += [replace(r, timestamp_ms=r.timestamp_ms + t0_ms) for r in part]
        t0_ms = out[-1].timestamp_ms + rng.expovariate(rate) * 1000.0
        next_id = max(max(r.hash_ids, default=0) for r in out) + 1
    return out
