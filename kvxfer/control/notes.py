"""D side of one-sided writes: the ``notify`` payloads that arrived, until drained."""
from __future__ import annotations

import collections

from .messages import Msg
from .state import AgentState


class Notifications:
    """NOTIFY messages received, in order; undrained ones count against their peer's limits."""

    def __init__(self, state: AgentState) -> None:
        self._s = state
        self._queue: collections.deque = collections.deque()

    def handlers(self) -> dict:
        return {Msg.NOTIFY: self._on_notify}

    def _on_notify(self, peer, f: dict) -> None:
        with self._s.lock:
            peer.book.add_note(len(f["data"]))  # LimitExceeded closes this peer only
            self._queue.append((peer, f["data"]))
        self._s.metrics.inc("notifications")

    def drain(self) -> list:
        """``[(peer, bytes), ...]`` received since the last call, in order."""
        with self._s.lock:
            out = list(self._queue)
            self._queue.clear()
            for peer, data in out:
                peer.book.drain_note(len(data))
        return out

    def clear(self) -> None:
        self._queue.clear()
