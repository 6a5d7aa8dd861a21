"""A record of every step an engine ran while serving: its chunks and its time.

A worker started with ``--step-log DIR`` (``kvxfer serve`` or ``kvxfer worker``)
appends to ``DIR/NAME.jsonl`` one JSON line per
:meth:`kvxfer.serving.engine.runtime.Runtime.step` that ran the model (about
60 bytes plus 10 a chunk; the file grows with every step: a profiling run's
tool, not a production setting)::

    {"chunks": [[num_tokens, start_pos], ...], "seconds": 0.0123, "t": 1.5}

``seconds`` covers what the simulated engine stands in for: the forward pass
and the sampling of the step's tokens (not the scheduler, which both engines
run). ``t`` is seconds since the log opened. The first line is a header
``{"header": {...}}`` naming the worker, its engine, the machine's CPU, the
CPUs it may run on, its threads, the model's KV bytes per token and the load
average at start.

``kvxfer profile --from-steps FILE ...`` fits a cost profile to such logs:
step times measured inside serving runs, with the contention of the other
workers, the router and the load generator on the same host, which a profile
of one process timing a grid alone does not see (docs/simulate.md).
"""
from __future__ import annotations

import json
import os
import time
from typing import Iterable, Sequence


def step_kind(chunks: Sequence[Sequence[int]]) -> str:
    """``decode`` (one-token chunks only), ``prefill`` (prompt chunks only) or ``mixed``."""
    sizes = [n for n, _ in chunks]
    if all(n == 1 for n in sizes):
        return "decode"
    return "prefill" if all(n > 1 for n in sizes) else "mixed"


class StepLog:
    """Appends steps to ``path`` as JSON lines; :meth:`record` is what a runtime calls."""

    def __init__(self, path: str, header: dict | None = None) -> None:
        if not isinstance(path, str) or not path:
            raise TypeError(f"step log path must be a non-empty str, got {path!r}")
        self.path = path
        self._f = open(path, "a", buffering=1)  # line-buffered: a killed worker loses nothing
        self._t0 = time.perf_counter()
        self.num_steps = 0
        head = {"pid": os.getpid(), "load_average": os.getloadavg()[0],
                "cpus": sorted(os.sched_getaffinity(0)), **(header or {})}
        self._f.write(json.dumps({"header": head}) + "\n")

    def record(self, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """One step: ``(num_tokens, start_pos)`` per chunk, and its time in seconds."""
        if self._f.closed:
            return
        spec = [[int(n), int(s)] for n, s in chunks]
        self._f.write(json.dumps({"chunks": spec, "seconds": round(seconds, 7),
                                  "t": round(time.perf_counter() - self._t0, 4)}) + "\n")
        self.num_steps += 1

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_step_log(path: str) -> tuple[dict, list[dict]]:
    """``(header, points)`` of a step log; points are ``{"kind", "chunks", "seconds"}`` as
    in a profile; the header is the last one (a restarted worker appends another).
    ``ValueError`` names the first malformed line; a last line cut short (a killed
    worker) is skipped."""
    header: dict = {}
    points = []
    with open(path) as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 1:  # the last line, cut short
                break
            raise ValueError(f"{path}:{i}: not JSON") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{i}: expected an object")
        if "header" in rec:
            header = dict(rec["header"])
            continue
        try:
            chunks = [[int(n), int(s)] for n, s in rec["chunks"]]
            seconds = float(rec["seconds"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{i}: a step needs chunks [[n, start], ...] and seconds") from None
        if not chunks or seconds <= 0 or any(n < 1 or s < 0 for n, s in chunks):
            raise ValueError(f"{path}:{i}: a step needs chunks with n >= 1 and start >= 0, "
                             f"and seconds > 0")
        points.append({"kind": step_kind(chunks), "chunks": chunks, "seconds": seconds})
    return header, points
