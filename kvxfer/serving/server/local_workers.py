"""``kvxfer worker`` processes that ``kvxfer serve --discovery URL --prefill N --decode M``
starts on its own host, kept alive.

The router finds them through discovery like any other worker; this module only
owns their processes. A supervisor thread polls them every ``POLL_S``; one that
exited without being asked is started again with the same command line (same
name: it publishes itself again under the same key, with a new address) after
a backoff of ``backoff_s`` doubling per consecutive quick death (exit within
``STABLE_AFTER_S`` of its start) up to ``backoff_max_s``. :meth:`stop` sends
SIGTERM (the worker drains, withdraws from discovery and exits) and kills what
is still running after the timeout. The workers get the environment as it was
when this object was made (the shared secret included).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

log = logging.getLogger("kvxfer.serve")

POLL_S = 0.2
STABLE_AFTER_S = 60.0


class _Supervised:
    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.quick_deaths = 0
        self.restarts = 0
        self.restart_at: float | None = None  # pending restart time (monotonic)

    def spawn(self, env: dict) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, env=env)
        self.started_at = time.monotonic()


class LocalWorkers:
    """Start ``argvs`` (one ``kvxfer worker`` command line each) and restart them when they die."""

    def __init__(self, argvs: list[list[str]], backoff_s: float = 1.0, backoff_max_s: float = 30.0):
        if backoff_s <= 0 or backoff_max_s < backoff_s:
            raise ValueError("need 0 < backoff_s <= backoff_max_s")
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.workers = [_Supervised(list(argv)) for argv in argvs]
        # A snapshot: the router pops the shared secret from its environment once it
        # has read it, and a restarted worker still needs it.
        self.env = dict(os.environ)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pids(self) -> list[int | None]:
        with self._lock:
            return [w.proc.pid if w.proc and w.proc.poll() is None else None for w in self.workers]

    def start(self) -> "LocalWorkers":
        with self._lock:
            for w in self.workers:
                w.spawn(self.env)
        if self.workers:
            self._thread = threading.Thread(target=self._supervise, name="local-workers", daemon=True)
            self._thread.start()
        return self

    def _supervise(self) -> None:
        while not self._stopping.wait(POLL_S):
            with self._lock:
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                for w in self.workers:
                    self._check(w, now)

    def _check(self, w: _Supervised, now: float) -> None:
        if w.restart_at is None:
            code = w.proc.poll()
            if code is None:
                return
            if now - w.started_at >= STABLE_AFTER_S:
                w.quick_deaths = 0
            delay = min(self.backoff_s * 2 ** min(w.quick_deaths, 16), self.backoff_max_s)
            w.quick_deaths += 1
            w.restart_at = now + delay
            log.error("local worker (pid %d) exited with %s; restarting in %.1fs",
                      w.proc.pid, code, delay)
        elif now >= w.restart_at:
            w.restart_at = None
            try:
                w.spawn(self.env)
            except OSError as exc:  # try again after the next backoff
                log.error("restarting a local worker failed: %s", exc)
                w.started_at, w.restart_at = now, now + self.backoff_max_s
                return
            w.restarts += 1
            log.warning("local worker restarted (pid %d, restart %d)", w.proc.pid, w.restarts)

    def stop(self, timeout_s: float) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            procs = [w.proc for w in self.workers if w.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # drain, withdraw from discovery, exit
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
