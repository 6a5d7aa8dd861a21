"""Admission of unauthenticated connections: cheap, bounded and fair per source.

Before a connection has proved the shared secret it may cost this agent little:
it holds one of :data:`MAX_PENDING_HANDSHAKES` slots, at most
:data:`MAX_PENDING_PER_SOURCE` of them per source address, must send its HELLO
within :data:`HELLO_DEADLINE_S` and finish within the handshake timeout, and
may buffer at most :data:`PREAUTH_MAX_FRAME` bytes. A source whose handshakes
failed :data:`MAX_FAILURES_PER_SOURCE` times within :data:`FAILURE_WINDOW_S`
is refused until the window passes. A refused connection gets a REJECT
(``code="busy"``) and is closed; the connecting agent raises
:class:`~kvxfer.errors.ConnectionRefused`. Runs on the I/O thread only.
"""
from __future__ import annotations

import collections
import time

MAX_PENDING_HANDSHAKES = 256
MAX_PENDING_PER_SOURCE = 16
HELLO_DEADLINE_S = 2.0
PREAUTH_MAX_FRAME = 4096  # bytes of one frame before authentication (HELLO and AUTH are ~100)
MAX_FAILURES_PER_SOURCE = 32
FAILURE_WINDOW_S = 10.0
MAX_SOURCES_TRACKED = 4096  # failure histories kept (the stalest are forgotten first)


class HandshakeGate:
    def __init__(self) -> None:
        self.total = 0
        self._pending: dict = collections.Counter()  # source -> handshakes in progress
        self._failures: collections.OrderedDict = collections.OrderedDict()  # source -> deque of times

    def admit(self, source: str) -> str | None:
        """Take a slot for ``source``; None if admitted, else why it is refused."""
        now = time.monotonic()
        fails = self._failures.get(source)
        if fails:
            while fails and fails[0] < now - FAILURE_WINDOW_S:
                fails.popleft()
            if len(fails) >= MAX_FAILURES_PER_SOURCE:
                return f"too many failed handshakes from {source}; retry in {FAILURE_WINDOW_S:g} s"
        if self._pending[source] >= MAX_PENDING_PER_SOURCE:
            return f"too many pending handshakes from {source}"
        if self.total >= MAX_PENDING_HANDSHAKES:
            return "too many pending handshakes"
        self._pending[source] += 1
        self.total += 1
        return None

    def release(self, source: str, ok: bool) -> None:
        """Give the slot back; ``ok=False`` records a failed handshake of ``source``."""
        self.total -= 1
        self._pending[source] -= 1
        if self._pending[source] <= 0:
            del self._pending[source]
        if ok:
            return
        fails = self._failures.pop(source, None) or collections.deque(maxlen=MAX_FAILURES_PER_SOURCE)
        fails.append(time.monotonic())
        self._failures[source] = fails  # most recent last
        while len(self._failures) > MAX_SOURCES_TRACKED:
            self._failures.popitem(last=False)
