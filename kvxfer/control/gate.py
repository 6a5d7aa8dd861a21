"""Admission of unauthenticated connections: cheap, bounded, and never a lockout.

Before a connection has proved the shared secret it may cost this agent little:
it holds one of :data:`MAX_PENDING_HANDSHAKES` slots, at most
:data:`MAX_PENDING_PER_SOURCE` of them per source address, must send its HELLO
within :data:`HELLO_DEADLINE_S` and authenticate within the handshake timeout,
and may buffer at most :data:`PREAUTH_MAX_FRAME` bytes. A connection frees its
slot the moment it authenticates.

A new connection is always admitted. When its source holds all its slots, the
source's oldest pending connection is evicted to make room; when all slots are
taken, the oldest of the source holding the most. Connections that have not sent
their HELLO yet go first, so an honest client -- whose HELLO follows its connect
at once and whose handshake takes milliseconds -- outlives any number of half-open
or reconnecting ones, also from its own address. An evicted connection gets a
REJECT (``code="busy"``) and is closed; its client raises
:class:`~kvxfer.errors.ConnectionRefused`. A failed handshake costs the one
connection that failed (it is closed at once) and nothing else: failures are not
counted per address, so nobody can lock an address out. Runs on the I/O thread only.
"""
from __future__ import annotations

import collections

MAX_PENDING_HANDSHAKES = 256
MAX_PENDING_PER_SOURCE = 16
HELLO_DEADLINE_S = 2.0
PREAUTH_MAX_FRAME = 4096  # bytes of one frame before authentication (HELLO and AUTH are ~100)


class HandshakeGate:
    """The pending (unauthenticated) connections, oldest first per source. An entry is
    any object with a ``source`` (address) and a ``said_hello`` (bool) attribute."""

    def __init__(self, max_pending: int = MAX_PENDING_HANDSHAKES,
                 max_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.total = 0
        self._pending: dict[str, collections.OrderedDict] = {}  # source -> {entry: None}, oldest first

    def admit(self, entry) -> list:
        """Give ``entry`` a slot; return the entries evicted for it (the caller closes them)."""
        evicted = []
        mine = self._pending.get(entry.source)
        if mine is not None and len(mine) >= self.max_per_source:
            evicted.append(self._evict(entry.source))
        if self.total >= self.max_pending:
            evicted.append(self._evict(max(self._pending, key=lambda s: len(self._pending[s]))))
        self._pending.setdefault(entry.source, collections.OrderedDict())[entry] = None
        self.total += 1
        return evicted

    def release(self, entry) -> bool:
        """Free ``entry``'s slot (it authenticated, failed or closed); False if it held none."""
        mine = self._pending.get(entry.source)
        if mine is None or mine.pop(entry, False) is False:
            return False
        self.total -= 1
        if not mine:
            del self._pending[entry.source]
        return True

    def pending(self, source: str) -> list:
        """The pending entries of ``source``, oldest first."""
        return list(self._pending.get(source, ()))

    def _evict(self, source: str):
        mine = self._pending[source]
        victim = next((e for e in mine if not e.said_hello), None)
        if victim is None:
            victim = next(iter(mine))
        self.release(victim)
        return victim
