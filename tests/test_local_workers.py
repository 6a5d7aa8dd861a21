"""kvxfer.serving.server.local_workers: processes restarted with backoff, stopped for good."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from kvxfer.serving.server.local_workers import LocalWorkers
from waiting import until


def _until(predicate):
    return until(predicate, "restart", timeout=30.0, interval=0.05)


SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _exec_environ(pid: int) -> bytes:
    """``pid``'s environment once it runs SLEEPER's image, else b"".

    A pid is known from fork on: until exec completes, /proc shows the parent's image
    (this process's start-up environment) or, mid-exec, an empty one."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if SLEEPER[-1].encode() not in f.read().split(b"\0"):
            return b""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def test_dead_process_restarted_with_the_same_command_and_environment():
    os.environ["KVXFER_TEST_LOCAL_WORKERS"] = "seen"
    workers = LocalWorkers([SLEEPER, SLEEPER], backoff_s=0.1, backoff_max_s=0.4).start()
    del os.environ["KVXFER_TEST_LOCAL_WORKERS"]  # as the router pops the shared secret
    try:
        first = _until(lambda: all(workers.pids) and workers.pids)
        os.kill(first[0], signal.SIGKILL)
        again = _until(lambda: workers.pids[0] not in (None, first[0]) and workers.pids)
        assert again[1] == first[1]  # the other one untouched
        assert workers.workers[0].restarts == 1 and workers.workers[0].quick_deaths == 1
        environ = until(lambda: _exec_environ(again[0]), "exec of the restarted worker", timeout=30.0)
        assert b"KVXFER_TEST_LOCAL_WORKERS=seen" in environ.split(b"\0")
        os.kill(again[0], signal.SIGKILL)  # a second quick death: a longer backoff
        _until(lambda: workers.pids[0] not in (None, again[0]))
        assert workers.workers[0].quick_deaths == 2
    finally:
        workers.stop(timeout_s=5)
    assert all(w.proc.poll() is not None for w in workers.workers)
    time.sleep(0.5)  # the supervisor is gone: nothing comes back
    assert workers.pids == [None, None]


def test_backoff_validation():
    with pytest.raises(ValueError):
        LocalWorkers([SLEEPER], backoff_s=0)
    with pytest.raises(ValueError):
        LocalWorkers([SLEEPER], backoff_s=2, backoff_max_s=1)
