"""Measure the embedded engine's step times: the points ``kvxfer profile`` fits.

Each point is one ``LlamaModel.forward`` over the chunks of a step (the
scheduler's cost is not part of it: the simulated engine runs the real
scheduler and sleeps only in place of the forward pass), timed
``repeats`` times after one warm-up step; the median is kept. Block tables
are disjoint per sequence, as in a real batch (the KV bytes' values do not
change the time).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

# (num_tokens, prefix) prompt chunks; decode (batch, context); mixed (batch, context, chunk)
PREFILL_GRID = ((16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (128, 256), (256, 512),
                (512, 512), (128, 1024), (64, 1536))
DECODE_GRID = tuple((b, c) for b in (1, 2, 4, 8, 16) for c in (32, 256, 1024))
MIXED_GRID = ((4, 256, 16), (4, 256, 64), (4, 256, 256), (16, 256, 16), (16, 256, 64),
              (16, 256, 256), (8, 1024, 128))


def step_points(repeats: int = 3) -> list[tuple[str, list[tuple[int, int]]]]:
    """Every step to time, as ``(kind, [(num_tokens, start_pos), ...])``."""
    steps = [("prefill", [(n, p)]) for n, p in PREFILL_GRID]
    steps += [("decode", [(1, c - 1)] * b) for b, c in DECODE_GRID]
    steps += [("mixed", [(1, c - 1)] * b + [(n, 0)]) for b, c, n in MIXED_GRID]
    return steps


def blocks_needed(block_size: int) -> int:
    """Pool size that holds the largest step of the grids with disjoint tables."""
    per_step = []
    for _, chunks in step_points():
        per_step.append(sum(-(-(n + s) // block_size) for n, s in chunks))
    return max(per_step)


def measure(model, block_size: int, repeats: int = 3,
            on_point: Callable[[dict], None] | None = None) -> list[dict]:
    """Time every grid step on ``model`` (a :class:`kvxfer.serving.model.model.LlamaModel`);
    returns profile points ``{"kind", "chunks", "seconds"}``."""
    from ..model.attention import Chunk

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    model.forward([Chunk(tuple(range(100, 164)), 0, (0, 1, 2, 3))])  # warm-up
    points = []
    for kind, chunks in step_points():
        batch, next_block = [], 0
        for i, (n, start) in enumerate(chunks):
            count = -(-(n + start) // block_size)
            table = tuple(range(next_block, next_block + count))
            next_block += count
            ids = tuple((7919 * (i + 1) * (k + 1)) % 30000 + 100 for k in range(n))
            batch.append(Chunk(ids, start, table))
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            model.forward(batch)
            times.append(time.perf_counter() - began)
        point = {"kind": kind, "chunks": [list(c) for c in chunks],
                 "seconds": statistics.median(times)}
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


def cpu_name() -> str:
    """This machine's CPU model and core count, for the profile's ``hardware`` field."""
    import os

    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"
