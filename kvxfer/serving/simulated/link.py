"""The modelled P/D link: a transfer's time is its real-model bytes over a NIC.

Each worker has one NIC, modelled as a FIFO: a transfer occupies the
sender's egress and then the receiver's ingress for ``bytes / bandwidth``,
after ``latency``. Transfers sharing a NIC queue behind each other (the
contention of several requests leaving one prefill worker, or landing on one
decode worker). The sender posts the real (scaled-down) write at once and
books it on its egress queue (its blocks are freed, and ``sent`` reports, at
the modelled end); the receiver books it on its ingress queue when the real
write has landed, which decides when the data counts as arrived. The
receiver does not see the sender's queue: a transfer that waited on a busy
egress is not delayed at the receiver by that wait.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A NIC's ``bandwidth_bytes_per_s`` and one-way ``latency_s``, with their source."""

    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("bandwidth_bytes_per_s", "latency_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"link {name} must be a finite number >= 0, got {value!r}")
        if self.bandwidth_bytes_per_s == 0:
            raise ValueError("link bandwidth must be > 0")

    def wide(self, tp: int) -> "Link":
        """This link on ``tp`` GPUs side by side (a TP group moves its KV slices in parallel)."""
        return self if tp == 1 else Link(self.bandwidth_bytes_per_s * tp, self.latency_s,
                                         f"{tp} x {self.source}")

    def seconds(self, nbytes: int) -> float:
        """Uncontended time of one transfer of ``nbytes``."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def as_dict(self) -> dict:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "latency_s": self.latency_s, "source": self.source}

    @classmethod
    def from_dict(cls, raw: dict) -> "Link":
        try:
            return cls(raw["bandwidth_bytes_per_s"], raw["latency_s"], str(raw.get("source", "")))
        except KeyError as exc:
            raise ValueError(f"link lacks {exc.args[0]}") from None


class NicQueue:
    """One NIC's FIFO: :meth:`reserve` books the next free slot for ``nbytes``.

    Thread-safe (the agent's completion threads may call it)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, now: float, nbytes: int) -> tuple[float, float]:
        """``(start, end)`` of a transfer of ``nbytes`` that is ready at ``now``:
        it starts once every earlier one has left the NIC and ends ``latency +
        nbytes / bandwidth`` later (the wire is busy for the bytes only)."""
        with self._lock:
            start = max(now, self._free_at)
            busy = nbytes / self.link.bandwidth_bytes_per_s
            self._free_at = start + busy
            return start, start + busy + self.link.latency_s
