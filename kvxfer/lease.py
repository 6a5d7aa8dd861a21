"""Leases: which blocks an agent has lent to in-flight transfers, and until when.

P holds a request's source blocks from ``send`` until the data is visible in D
(or the transfer failed, was cancelled, or the lease expired); D holds its
destination blocks from ``recv`` until the transfer ended *and* no peer can
still write into them. Every lease ends exactly once, with a reason, through
``on_release(request_id, block_ids, reason)`` -- the engine's hook to free
blocks -- and :meth:`LeaseTable.held` answers "what is still lent out".
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

REASONS = ("done", "cancelled", "failed", "expired", "closed")


@dataclass
class Lease:
    key: tuple
    request_id: str
    block_ids: tuple
    deadline: float
    released: str | None = field(default=None)


class LeaseTable:
    def __init__(self, default_ttl_s: float, on_release=None) -> None:
        if default_ttl_s <= 0:
            raise ValueError("lease_timeout must be positive")
        self.default_ttl_s = default_ttl_s
        self._on_release = on_release
        self._leases: dict[tuple, Lease] = {}
        self._lock = threading.Lock()

    def acquire(self, key: tuple, request_id: str, block_ids, ttl_s: float | None = None) -> Lease:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        lease = Lease(key, request_id, tuple(int(b) for b in block_ids), time.monotonic() + ttl)
        with self._lock:
            if key in self._leases:
                raise ValueError(f"request {request_id!r} already holds blocks here")
            self._leases[key] = lease
        return lease

    def release(self, key: tuple, reason: str) -> bool:
        """End the lease (once); call the hook outside the lock. False if already released."""
        if reason not in REASONS:
            raise ValueError(f"unknown release reason {reason!r}; one of {REASONS}")
        with self._lock:
            lease = self._leases.pop(key, None)
        if lease is None:
            return False
        lease.released = reason
        if self._on_release is not None:
            self._on_release(lease.request_id, lease.block_ids, reason)
        return True

    def get(self, key: tuple) -> Lease | None:
        with self._lock:
            return self._leases.get(key)

    def held(self) -> dict:
        """``{request_id: block_ids}`` of every lease not yet released."""
        with self._lock:
            out: dict = {}
            for lease in self._leases.values():
                out[lease.request_id] = out.get(lease.request_id, ()) + lease.block_ids
            return out

    def keys(self) -> list:
        with self._lock:
            return list(self._leases)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
