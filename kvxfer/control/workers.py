"""A worker thread of an agent: runs jobs (descriptors/pack/post/wait, unpack) off the I/O thread."""
from __future__ import annotations

import logging
import queue
import threading

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
