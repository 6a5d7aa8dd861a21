"""The connector's worker half sleeps through an idle engine step while transfers are in
flight (so vLLM's empty steps do not spin a core the copy needs), wakes at once when one
ends, and never sleeps when nothing is in flight. No vLLM needed: the half is driven
directly, as the connector drives it."""
from __future__ import annotations

import threading
import time

from kvxfer.integrations.vllm_config import ConnectorConfig
from kvxfer.integrations.vllm_worker import WorkerHalf


def half():
    return WorkerHalf(ConnectorConfig(role="producer", secret=b"s" * 16), "p")


class Handle:  # what results() reads of a finished send handle
    state, nbytes, created, finished, request_id, path = "done", 4096, 1.0, 1.5, "r", "vm"


def test_idle_wait_returns_the_end_that_arrives_while_it_sleeps():
    w = half()
    w._sends["req-1"] = Handle()
    timer = threading.Timer(0.05, w._on_release, ("req-1", [1, 2], "done"))
    timer.start()
    t0 = time.monotonic()
    sending, recving, failed = w.results(idle_wait=30.0)
    assert sending == {"req-1"} and not recving and not failed
    assert time.monotonic() - t0 < 10.0  # woken by the end, not by the 30 s bound
    timer.join()


def test_idle_wait_is_bounded_when_nothing_ends():
    w = half()
    w._sends["req-1"] = Handle()
    t0 = time.monotonic()
    assert w.results(idle_wait=0.2) == (set(), set(), set())
    assert 0.15 <= time.monotonic() - t0 < 10.0
    assert "req-1" in w._sends  # still in flight, reported by a later step


def test_no_wait_without_transfers_in_flight_or_with_an_end_queued():
    w = half()
    t0 = time.monotonic()
    assert w.results(idle_wait=30.0) == (set(), set(), set())  # nothing in flight
    w._sends["req-2"] = Handle()
    w._on_release("req-2", [3], "done")  # already ended before the step looks
    assert w.results(idle_wait=30.0)[0] == {"req-2"}
    assert time.monotonic() - t0 < 10.0
