"""Per-agent counters and histograms, read as a dict (:meth:`Metrics.to_dict`).

Durations are split the way transfer engines report them: ``prepare`` (path choice,
descriptors, pack), ``post`` (handing descriptors to the backend) and
``transfer`` (request matched -> data visible in the destination).
"""
from __future__ import annotations

import bisect
import threading

# seconds: 10 us .. 10 s
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
           2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

COUNTERS = {
    "bytes_sent": "bytes written (or read) into a peer's pool by this agent",
    "bytes_received": "bytes that landed in this agent's pool from peers",
    "transfers": "completed transfers by kind and path",
    "failures": "failed transfers by kind and error",
    "notifications": "notifications received",
    "malformed_messages": "per-request messages of authenticated peers that did not decode (that request failed)",
    "evicted_handshakes": "pending inbound handshakes closed to admit newer connections (REJECT busy)",
    "failed_handshakes": "inbound connections closed before they authenticated (bad frame, wrong proof, timeout)",
}
HISTOGRAMS = {
    "prepare_seconds": "descriptors (+ pack) per chunk",
    "post_seconds": "backend post + completion per chunk",
    "transfer_seconds": "match to data visible, per transfer",
}


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.count += 1
        self.sum += value

    def to_dict(self) -> dict:
        return {"count": self.count, "sum": self.sum,
                "buckets": dict(zip([*map(str, BUCKETS), "+Inf"], self.counts))}


class Metrics:
    def __init__(self, agent: str) -> None:
        self.agent = agent
        self._lock = threading.Lock()
        self._counters: dict[tuple, float] = {}
        self._hists: dict[tuple, Histogram] = {}
        self.info: dict[str, str] = {}  # e.g. backend, transport per peer

    def inc(self, name: str, value: float = 1, **labels) -> None:
        if name not in COUNTERS:
            raise ValueError(f"unknown counter {name!r}")
        key = (name, tuple(sorted(labels.items())) if len(labels) > 1 else tuple(labels.items()))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value

    def observe(self, name: str, seconds: float, **labels) -> None:
        if name not in HISTOGRAMS:
            raise ValueError(f"unknown histogram {name!r}")
        key = (name, tuple(sorted(labels.items())) if len(labels) > 1 else tuple(labels.items()))
        with self._lock:
            hist = self._hists.get(key)
            if hist is None:
                hist = self._hists[key] = Histogram()
            hist.observe(seconds)

    def counter(self, name: str, **labels) -> float:
        """Sum of ``name`` over every label set matching ``labels``."""
        want = set(labels.items())
        with self._lock:
            return sum(v for (n, lab), v in self._counters.items() if n == name and want <= set(lab))

    def to_dict(self) -> dict:
        with self._lock:
            counters: dict = {}
            for (name, labels), value in sorted(self._counters.items()):
                counters.setdefault(name, []).append({"labels": dict(labels), "value": value})
            hists: dict = {}
            for (name, labels), h in sorted(self._hists.items(), key=lambda kv: kv[0]):
                hists.setdefault(name, []).append({"labels": dict(labels), **h.to_dict()})
            return {"agent": self.agent, "info": dict(self.info), "counters": counters,
                    "histograms": hists}
