"""One TCP control connection of the agent's I/O loop (:mod:`kvxfer.control.loop`).

Any thread may send: :meth:`Conn.send` queues the frame and writes what the socket takes
at once; the loop's thread flushes the rest when the socket becomes writable, so no
thread ever blocks on a slow peer. Only the loop's thread reads (``reader``).
"""
from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING

from .framing import FrameReader

if TYPE_CHECKING:
    from .loop import IOLoop

MAX_OUTBUF = 64 << 20  # a peer that stops reading this much control traffic is dropped
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


class Conn:
    """One TCP control connection; ``handler`` gets ``on_frame``/``on_close`` callbacks."""

    def __init__(self, sock: socket.socket, handler, loop: "IOLoop") -> None:
        self.sock = sock
        self.handler = handler
        self.loop = loop
        self.reader = FrameReader()
        self.closed = False
        self.peer = None  # set by the agent once the handshake completed
        self._send_lock = threading.Lock()
        self._out = bytearray()  # bytes the socket did not take yet; the loop flushes them
        sock.setblocking(False)

    def send(self, frame: bytes, more: bool = False) -> bool:
        """Queue one whole frame and write what the socket takes now; never blocks.

        Returns False (and the connection closes) if the peer is gone or stopped
        reading. Frames keep their order; the I/O thread flushes the rest.
        ``more``: another frame follows shortly from this thread; the kernel may hold
        this one back (``MSG_MORE``, at most ~200 ms) to send both in one segment. A
        held frame still reaches the peer if this process dies (close flushes it).
        """
        err = None
        with self._send_lock:
            if self.closed:
                return False
            was_idle = not self._out
            if was_idle:  # common case: hand the frame to the kernel without copying it
                try:
                    sent = self.sock.send(frame, _MSG_MORE if more else 0)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    err, sent = exc, len(frame)
                if sent < len(frame):
                    self._out += memoryview(frame)[sent:]
            else:
                self._out += frame
            if err is None and len(self._out) > MAX_OUTBUF:
                err = ConnectionError("peer stopped reading its control connection")
            need_write = err is None and was_idle and bool(self._out)
        if err is not None:
            self.loop.close_conn(self, err)
            return False
        if need_write:
            self.loop.call_soon(lambda: self.loop._watch_write(self, True))
        return True

    def _flush_locked(self):
        try:
            while self._out:
                sent = self.sock.send(self._out)
                del self._out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            return exc
        return None

    def flush(self) -> None:
        """I/O thread: the socket is writable."""
        with self._send_lock:
            err = None if self.closed else self._flush_locked()
            idle = not self._out
        if err is not None:
            self.loop._close(self, err)
        elif idle:
            self.loop._watch_write(self, False)

    def __repr__(self) -> str:
        return f"<Conn fd={self.sock.fileno() if not self.closed else -1} peer={self.peer!r}>"
