"""Synthetic requests: Poisson arrivals at a fixed rate, in the trace's own format.

Every request starts with ``shared_blocks`` common hash ids (a shared system
prompt, reused by prefix caching) followed by ids of its own; input and output
lengths are drawn uniformly within ``±spread`` of the given means.
"""
from __future__ import annotations

import math
import random

from .trace import BLOCK_TOKENS, TraceRequest


def poisson_requests(*, rate: float, num_requests: int, input_length: int, output_length: int,
                     spread: float = 0.0, shared_blocks: int = 0, seed: int = 0) -> list[TraceRequest]:
    """``num_requests`` requests with exponential inter-arrival times of mean ``1/rate`` s."""
    if rate <= 0 or num_requests < 1 or input_length < 1 or output_length < 1:
        raise ValueError("rate, num_requests, input_length and output_length must be positive")
    if not 0.0 <= spread < 1.0 or shared_blocks < 0:
        raise ValueError("spread must be in [0, 1) and shared_blocks >= 0")
    rng = random.Random(seed)
    next_id = shared_blocks
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
