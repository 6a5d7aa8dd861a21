"""Mooncake-format traces: one JSON object per line.

Fields (Mooncake's ``conversation_trace``): ``timestamp`` (ms since trace start),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per
512-token block of the prompt; equal ids at the same position mean an equal
prefix, e.g. a shared system prompt).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

BLOCK_TOKENS = 512  # tokens per hash id in Mooncake traces


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self):
        if self.timestamp_ms < 0 or self.input_length < 1 or self.output_length < 1:
            raise ValueError(f"invalid trace request {self}")


def parse_line(line: str, lineno: int = 0) -> TraceRequest:
    try:
        obj = json.loads(line)
        return TraceRequest(
            timestamp_ms=float(obj["timestamp"]),
            input_length=int(obj["input_length"]),
            output_length=int(obj["output_length"]),
            hash_ids=tuple(int(h) for h in obj.get("hash_ids", ())),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"trace line {lineno}: {exc}") from exc


def read_trace(path: str | Path, *, start: int = 0, max_requests: int | None = None) -> list[TraceRequest]:
    """Requests ``start .. start+max_requests`` of the trace, timestamps rebased to the first.

    Rebasing lets a slice from the middle of a long trace start immediately.
    """
    if start < 0 or (max_requests is not None and max_requests < 1):
        raise ValueError("start must be >= 0 and max_requests >= 1")
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if lineno - 1 < start or not line.strip():
                continue
            out.append(parse_line(line, lineno))
            if max_requests is not None and len(out) >= max_requests:
                break
    if not out:
        raise ValueError(f"{path}: no requests at start={start}")
    t0 = out[0].timestamp_ms
    return [TraceRequest(r.timestamp_ms - t0, r.input_length, r.output_length, r.hash_ids) for r in out]


def jitter(requests: list[TraceRequest], window_ms: float, *, seed: int = 0) -> list[TraceRequest]:
    """Each request moved to a uniform time in ``[timestamp, timestamp + window_ms)``, sorted.

    Mooncake's traces round arrivals to 3,000 ms buckets, so a replay sends each bucket's
    requests at once; spreading them over their bucket (``window_ms=3000``) gives the
    arrival process the bucket counts imply. Seeded: the same seed gives the same times.
    """
    if not window_ms >= 0:
        raise ValueError(f"jitter window must be >= 0 ms, got {window_ms}")
    rng = random.Random(seed)
    moved = [replace(r, timestamp_ms=r.timestamp_ms + rng.uniform(0.0, window_ms)) for r in requests]
    return sorted(moved, key=lambda r: r.timestamp_ms)
