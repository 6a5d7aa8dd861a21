"""The agent's I/O thread: one selector over the listening socket and every peer.

It blocks in ``select`` with the time to the next timer as timeout, so an idle
agent burns no CPU. With ``spin_s`` > 0 it first busy-polls (native, GIL
released, yielding the CPU each round) for up to ``spin_s`` after its last
event (or :meth:`IOLoop.kick`), and only while ``spin_if()`` says a transfer is
outstanding: a reply that follows a request is then read without a thread
wake-up (tens of µs for both sides on a VM), and an idle agent still blocks. Frames are decoded here and
handed to the connection's handler; a connection whose bytes do not parse is
closed alone, the others keep running. A whole frame whose per-request payload
does not decode (:class:`~kvxfer.agent.protocol.MalformedPayload`) goes to the handler's
``on_malformed``, which may fail just the request it names and keep the connection. Any thread may *send* (``Conn.send``
queues the frame and writes what the socket takes at once; this thread flushes
the rest when the socket becomes writable, so no thread ever blocks on a slow
peer); only this thread reads.


:class:`Conn` is one TCP control connection of the loop; the two are one concept
(the loop reads and flushes a connection's buffers, a connection asks the loop to
watch it for writability or to close it).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import socket
import threading
import time

from .. import _native
from ..errors import KVXferError, ProtocolError
from ..framing import FrameReader
from .protocol import MalformedPayload, decode


log = logging.getLogger("kvxfer")

# A poll yields the CPU every round; a yield that takes longer than this means another
# task ran for most of a time slice (this agent's own threads run far shorter between
# waits): the CPU is contended, and a polling thread would wait a whole slice to get it
# back, where a blocked one woken by its message preempts. The loop then blocks and
# does not poll for SPIN_BACKOFF_S (2 ms: the contending task is often this process's own
# thread between two trips; 50 ms kept the loop from polling for dozens of round trips).
SPIN_CONTENDED_NS = 200_000
SPIN_BACKOFF_S = 0.002


class Timer:
    """What :meth:`IOLoop.call_later` returns: :meth:`cancel` drops the callback (and what it
    refers to) at once; the loop skips the entry when its deadline comes, or drops it
    earlier when cancelled entries make up most of the heap."""

    __slots__ = ("fn", "_loop")

    def __init__(self, fn, loop: "IOLoop") -> None:
        self.fn = fn
        self._loop = loop

    def cancel(self) -> None:
        if self.fn is not None:
            self.fn = None
            self._loop._cancelled += 1  # a hint for compaction; need not be exact


class _FdWatch:
    """A foreign fd the loop watches for readability (not owned: never closed here)."""

    def __init__(self, fd: int, fn) -> None:
        self.fd = fd
        self.fn = fn


class IOLoop:
    def __init__(self, listen_sock: socket.socket, on_accept, name: str, *, spin_s: float = 0.0,
                 spin_if=None) -> None:
        self._spin_ns = int(spin_s * 1e9) if spin_if is not None else 0
        self._spin_if = spin_if  # () -> bool: something outstanding a peer's message will move
        self._spin_until = 0.0  # monotonic end of the poll window after the last event
        self._spin_off_until = 0.0  # no polling before this (the CPU was contended)
        self._spin_readable = _native.load().spin_readable if self._spin_ns > 0 else None
        self._sel = selectors.DefaultSelector()
        self._listen = listen_sock
        self._on_accept = on_accept  # (sock, source address) -> handler or None (refused: closed)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._lock = threading.Lock()
        self._pending: list = []  # callables from other threads
        self._timers: list = []  # heap of (deadline, seq, Timer); guarded by _lock
        self._cancelled = 0  # about how many heap entries are cancelled timers
        self._sleep_until = 0.0  # monotonic deadline of the current select (inf: none)
        self._seq = itertools.count()
        self._conns: set[Conn] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-io-{name}", daemon=True)
        self._thread.start()

    # ---- thread-safe API ------------------------------------------------------
    def call_soon(self, fn) -> None:
        with self._lock:
            self._pending.append(fn)
        self._wake()

    def call_later(self, delay_s: float, fn) -> Timer:
        """Run ``fn`` on the loop thread after ``delay_s`` unless the returned timer is
        cancelled first. The loop is woken only if this deadline is earlier than the one
        it sleeps towards (a lease timer per request must not cost a thread wake-up per
        request)."""
        deadline = time.monotonic() + max(0.0, delay_s)
        timer = Timer(fn, self)
        with self._lock:
            timers = self._timers
            if self._cancelled > 256 and self._cancelled > len(timers) // 2:
                # a lease timer per request, most cancelled long before their deadline
                timers[:] = [t for t in timers if t[2].fn is not None]
                heapq.heapify(timers)
                self._cancelled = 0
            heapq.heappush(timers, (deadline, next(self._seq), timer))
            wake = deadline < self._sleep_until
        if wake:
            self._wake()
        return timer

    def kick(self) -> None:
        """A request went out from another thread: open the poll window now (waking the
        loop if it blocks), so the reply is read without a wake-up (no-op without spin)."""
        if self._spin_ns:
            now = time.monotonic()
            if now < self._spin_off_until:
                return
            self._spin_until = now + self._spin_ns * 1e-9
            if self._sleep_until > 0.0:
                self._wake()

    def add_conn(self, sock: socket.socket, handler, peer=None) -> Conn:
        conn = Conn(sock, handler, self)
        conn.peer = peer
        if peer is not None:
            peer.conn = conn  # before the loop can read (and answer) a first frame
        self.call_soon(lambda: self._register(conn))
        return conn

    def add_reader(self, fd: int, fn) -> None:
        """Call ``fn()`` on the loop thread whenever ``fd`` is readable (the caller owns ``fd``)."""
        watch = _FdWatch(fd, fn)
        self.call_soon(lambda: None if self._stopping else self._sel.register(fd, selectors.EVENT_READ, watch))

    def close_conn(self, conn: Conn, exc: BaseException | None = None) -> None:
        self.call_soon(lambda: self._close(conn, exc))

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def num_conns(self) -> int:
        return len(self._conns)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    # ---- loop thread ----------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken, or shutting down

    def _register(self, conn: Conn) -> None:
        if self._stopping or conn.closed:
            self._close(conn, None)
            return
        self._conns.add(conn)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn._out else 0)
        self._sel.register(conn.sock, events, conn)

    def _watch_write(self, conn: Conn, on: bool) -> None:
        if conn.closed or conn not in self._conns:
            return  # _register will look at the pending bytes
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        self._sel.modify(conn.sock, events, conn)

    def _close(self, conn: Conn, exc) -> None:
        with conn._send_lock:
            if conn.closed:
                return
            conn.closed = True
        if conn in self._conns:
            self._conns.discard(conn)
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        try:
            conn.sock.close()
        except OSError:
            pass
        try:
            conn.handler.on_close(conn, exc)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the loop
            log.exception("close handler of a control connection raised")

    def _timeout(self) -> float | None:
        with self._lock:
            if self._pending:
                self._sleep_until = 0.0
                return 0.0
            if not self._timers:
                self._sleep_until = float("inf")
                return None
            self._sleep_until = self._timers[0][0]
        return max(0.0, self._sleep_until - time.monotonic())

    def _poll_window(self, timeout: float | None) -> float | None:
        """Busy-poll while the window after the last event is open and something is
        outstanding; the ``select`` timeout to use then (0 once a descriptor is ready)."""
        now = time.monotonic()
        left = self._spin_until - now
        if left <= 0.0 or now < self._spin_off_until or not self._spin_if():
            return timeout
        ns = int(left * 1e9) if timeout is None else int(min(left, timeout) * 1e9)
        ready = self._spin_readable(self._sel.fileno(), min(ns, self._spin_ns), SPIN_CONTENDED_NS)
        if ready > 0:
            return 0.0
        if ready < 0:
            self._spin_off_until = time.monotonic() + SPIN_BACKOFF_S
        return self._timeout()

    def _run(self) -> None:
        try:
            while not self._stopping:
                timeout = self._timeout()
                if self._spin_ns and timeout != 0.0:
                    timeout = self._poll_window(timeout)
                events = self._sel.select(timeout)
                if events and self._spin_ns:
                    self._spin_until = time.monotonic() + self._spin_ns * 1e-9
                for key, mask in events:
                    if key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    elif key.data is None:
                        self._accept()
                    elif isinstance(key.data, _FdWatch):
                        key.data.fn()
                    else:
                        if mask & selectors.EVENT_WRITE:
                            key.data.flush()
                        if mask & selectors.EVENT_READ and not key.data.closed:
                            self._read(key.data)
                with self._lock:
                    pending, self._pending = self._pending, []
                for fn in pending:
                    fn()
                now = time.monotonic()
                while True:
                    with self._lock:
                        if not self._timers or self._timers[0][0] > now:
                            break
                        timer = heapq.heappop(self._timers)[2]
                        if timer.fn is None:
                            self._cancelled = max(0, self._cancelled - 1)
                    fn, timer.fn = timer.fn, None
                    if fn is not None:
                        fn()
        finally:
            for conn in list(self._conns):
                self._close(conn, KVXferError("agent closed"))
            for sock in (self._listen, self._wake_r, self._wake_w):
                try:
                    sock.close()
                except OSError:
                    pass
            self._sel.close()
            with self._lock:  # drop the callbacks (they refer back to the agent)
                self._timers.clear()
                self._pending.clear()
            self._on_accept = None

    def _accept(self) -> None:
        try:
            sock, addr = self._listen.accept()
        except OSError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handler = self._on_accept(sock, addr[0])
        if handler is None:
            sock.close()
            return
        conn = Conn(sock, handler, self)
        self._register(conn)
        handler.on_open(conn)

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(conn, exc)
            return
        if not data:
            self._close(conn, ConnectionError("connection closed by peer"))
            return
        try:
            table = conn.dispatch
            for msg_type, payload in conn.reader.feed(data):
                try:
                    kind, fields = decode(msg_type, payload)
                except MalformedPayload as exc:  # the frame is whole: the handler may fail one request
                    conn.handler.on_malformed(conn, exc)  # raises to close the connection
                    if conn.closed:
                        return
                    continue
                if table is not None:  # authenticated: straight to the frame's owner
                    fn = table.get(kind)
                    if fn is None:
                        raise ProtocolError(f"unexpected {kind.name} after the handshake")
                    fn(conn.peer, fields)
                else:
                    conn.handler.on_frame(conn, kind, fields)
                    table = conn.dispatch  # set once the handshake completed
                if conn.closed:
                    return
        except Exception as exc:  # noqa: BLE001 - ProtocolError, or a typed error from the handler
            if not isinstance(exc, KVXferError):  # a handler bug: say where, then drop the peer
                log.exception("control frame handler raised; closing the connection")
            self._close(conn, exc if isinstance(exc, KVXferError) else ProtocolError(repr(exc)))


# ---- one control connection -----------------------------------------------------
MAX_OUTBUF = 64 << 20  # a peer that stops reading this much control traffic is dropped
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


class Conn:
    """One TCP control connection. ``handler`` gets ``on_open`` (accepted connections),
    ``on_frame``, ``on_malformed`` and ``on_close``; once ``dispatch`` is set (a
    ``{Msg: fn(peer, fields)}`` table, when the handshake completed) the loop hands every
    frame straight to its owner's function instead of ``on_frame``."""

    def __init__(self, sock: socket.socket, handler, loop: IOLoop) -> None:
        self.sock = sock
        self.handler = handler
        self.loop = loop
        self.reader = FrameReader()
        self.closed = False
        self.peer = None  # set by the agent once the handshake completed
        self.dispatch: dict | None = None  # {Msg: fn(peer, fields)} once authenticated (see the class doc)
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
