"""The agent's threads besides the I/O loop: the FIFO worker, and the backend driver.

:class:`Worker` is one daemon thread that runs jobs (descriptors/pack/post/wait,
unpack) off the I/O thread. :class:`BackendDriver` drives the backend from the I/O
thread (target-side progress).

UCX serves emulated RMA (TCP), and accepts and reaps the connections peers open
and close, only while this process progresses it. The backend's event fd
(:meth:`~kvxfer.transport.base.Backend.event_fd`) wakes the I/O thread whenever
UCX has such work, so an idle agent sleeps and still completes a one-sided write
into it and closes the sockets of departed peers. Once a peer is reached through
a transport that needs it (:meth:`~kvxfer.transport.base.Backend.needs_progress`),
a timer also progresses every ``progress_busy_s`` while ``busy()`` (a recv,
staging grant or cancellation pending) and every ``progress_idle_s`` otherwise (a
missed wake-up costs at most that).
"""
from __future__ import annotations

import logging
import queue
import threading

from ..errors import KVXferError
from .state import AgentState


log = logging.getLogger("kvxfer.agent")


class Worker:
    """One daemon thread draining a FIFO of callables. A job fails its own request on
    error; should one still raise, it is logged and the worker goes on (a dead worker
    would stall every later transfer)."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._jobs = 0  # submitted and not finished
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job) -> None:
        with self._lock:
            self._jobs += 1
        self._q.put(job)

    def idle(self) -> bool:
        """No job queued or running (a hint: read without the lock)."""
        return self._jobs == 0

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the queued jobs, then end the thread (joined unless called from it)."""
        self._q.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - second line of defence, logged
                log.exception("kvxfer worker job raised")
            finally:
                with self._lock:
                    self._jobs -= 1


# ---- target-side progress --------------------------------------------------------


class BackendDriver:
    """Owns the backend's event-fd watch and the progress timer (I/O thread only)."""

    def __init__(self, state: AgentState, busy) -> None:
        self._s = state
        self._busy = busy  # () -> bool: something waits on the target side
        self._ticking = False

    def start(self) -> None:
        """Watch the backend's event fd (if it has one) and drain what came before."""
        fd = self._s.backend.event_fd()
        if fd is not None:
            self._s.loop.add_reader(fd, self.on_event)
            self._s.loop.call_soon(self.on_event)

    def on_event(self) -> None:
        """The fd fired: drive the backend and re-arm (again soon while busy)."""
        if self._s.closed:
            return
        try:
            armed = self._s.backend.arm()
        except KVXferError as exc:  # the timer keeps driving it
            armed = True
            self._s.metrics.inc("failures", kind="progress", error=type(exc).__name__)
            log.warning("agent %r: arming the backend failed: %s", self._s.name, exc)
        if not armed:
            self._s.loop.call_soon(self.on_event)

    def peer_connected(self, bconn) -> None:
        """Start the timer once a peer's transport needs target-side progress (any thread)."""
        if not self._s.backend.needs_progress(bconn):
            return
        with self._s.lock:
            if self._ticking:
                return
            self._ticking = True
        self._s.loop.call_later(self._s.config.progress_busy_s, self._tick)

    def _tick(self) -> None:
        if self._s.closed:
            return
        cfg = self._s.config
        busy = self._busy()
        if busy:
            self._s.backend.progress()
        else:
            self.on_event()
        self._s.loop.call_later(cfg.progress_busy_s if busy else cfg.progress_idle_s, self._tick)
