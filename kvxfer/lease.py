"""Leases: which blocks an agent has lent to in-flight transfers, and until when.

P holds a request's source blocks from ``send`` until the data is visible in D
(or the transfer failed, was cancelled, or the lease expired); D holds its
destination blocks from ``recv`` until the transfer ended *and* no peer can
still write into them. Every lease ends exactly once, with a reason, through
``on_release(request_id, block_ids, reason)`` -- the engine's hook to free
blocks -- and :meth:`LeaseTable.held` answers "what is still lent out".

A block D receives into is written: while its lease lasts no other transfer of
this agent may name it (a second recv would land another request's bytes in it,
a send would read it half written). Blocks P sends from are only read, so sends
may share them (a prefix held by several requests).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .errors import BlocksBusy
from .timeouts import check_timeout

REASONS = ("done", "cancelled", "failed", "expired", "closed")


@dataclass
class Lease:
    key: tuple
    request_id: str
    block_ids: tuple
    deadline: float
    writes: bool = False  # the transfer writes these blocks (a recv): nobody else may name them
    released: str | None = field(default=None)


class LeaseTable:
    """Every lease of one agent, keyed by its transfer. A writing lease (a recv's
    destination blocks) excludes every other lease of those blocks; reading leases (a
    send's source blocks) may share blocks with each other: :meth:`acquire` raises
    :class:`~kvxfer.errors.BlocksBusy` on a conflict and takes nothing."""

    def __init__(self, default_ttl_s: float, on_release=None) -> None:
        self.default_ttl_s = check_timeout(default_ttl_s, "lease_timeout")
        if self.default_ttl_s is None:
            raise ValueError("lease_timeout must be a finite number of seconds > 0, got None")
        self._on_release = on_release
        self._leases: dict[tuple, Lease] = {}
        self._writer: dict[int, Lease] = {}  # block -> the writing lease holding it
        self._readers: dict[int, int] = {}  # block -> how many reading leases hold it
        self._lock = threading.Lock()

    def acquire(self, key: tuple, request_id: str, block_ids: tuple, ttl_s: float | None = None, *,
                writes: bool = False) -> Lease:
        """Lease ``block_ids`` (validated Python ints) to transfer ``key`` for ``ttl_s``
        seconds (None: the default). ValueError: ``key`` holds a lease already or the ttl
        is not a finite number > 0; BlocksBusy: a conflicting lease holds one of the blocks."""
        ttl = self.default_ttl_s if ttl_s is None else check_timeout(ttl_s, "lease_timeout")
        lease = Lease(key, request_id, tuple(block_ids), time.monotonic() + ttl, writes)
        with self._lock:
            if key in self._leases:
                raise ValueError(f"request {request_id!r} already holds blocks here")
            writer, readers = self._writer, self._readers
            for b in lease.block_ids:
                other = writer.get(b)
                if other is None and writes and b in readers:
                    other = next(x for x in self._leases.values() if not x.writes and b in x.block_ids)
                if other is not None:
                    raise BlocksBusy(f"block {b} is held by the pending {'recv' if other.writes else 'send'} "
                                     f"of {other.request_id!r}; {request_id!r} may not name it")
            if writes:
                for b in lease.block_ids:
                    writer[b] = lease
            else:
                for b in lease.block_ids:
                    readers[b] = readers.get(b, 0) + 1
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
            if lease.writes:
                for b in lease.block_ids:
                    if self._writer.get(b) is lease:
                        del self._writer[b]
            else:
                readers = self._readers
                for b in lease.block_ids:
                    n = readers[b] - 1
                    if n:
                        readers[b] = n
                    else:
                        del readers[b]
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
