"""The connector's worker half sleeps through an idle engine step while transfers are in
flight (so vLLM's empty steps do not spin a core the copy needs), on the event the
agent's release callback sets, and never sleeps when nothing is in flight or an end is
already queued. No vLLM needed: the half is driven directly, as the connector drives it,
with its wake event replaced by one that records each wait (no timing in the test)."""
from __future__ import annotations

from kvxfer.integrations.vllm_config import ConnectorConfig
from kvxfer.integrations.vllm_worker import WorkerHalf


class Handle:  # what results() reads of a finished send handle
    state, nbytes, created, finished, request_id, path = "done", 4096, 1.0, 1.5, "r", "vm"


class RecordingEvent:
    """Stands in for the wake event: records each wait; ``arrives`` is released during it."""

    def __init__(self, half: WorkerHalf, arrives: str | None = None) -> None:
        self.half, self.arrives, self.waits = half, arrives, []

    def clear(self) -> None:
        pass

    def set(self) -> None:
        pass

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        if self.arrives is not None:
            self.half._on_release(self.arrives, [1], "done")
        return self.arrives is not None


def half():
    return WorkerHalf(ConnectorConfig(role="producer", secret=b"s" * 16), "p")


def test_idle_step_waits_for_the_end_of_a_transfer_in_flight():
    w = half()
    w._sends["req-1"] = Handle()
    w._wake = RecordingEvent(w, arrives="req-1")
    assert w.results(idle_wait=0.005) == ({"req-1"}, set(), set())
    assert w._wake.waits == [0.005]


def test_idle_wait_with_no_end_leaves_the_transfer_in_flight():
    w = half()
    w._sends["req-1"] = Handle()
    w._wake = RecordingEvent(w)
    assert w.results(idle_wait=0.005) == (set(), set(), set())
    assert w._wake.waits == [0.005] and "req-1" in w._sends  # reported by a later step


def test_no_wait_without_transfers_in_flight_with_an_end_queued_or_in_a_busy_step():
    w = half()
    w._wake = RecordingEvent(w)
    assert w.results(idle_wait=0.005) == (set(), set(), set())  # nothing in flight
    w._sends["req-2"] = Handle()
    assert w.results(idle_wait=0.0) == (set(), set(), set())  # the step had work
    w._on_release("req-2", [3], "done")  # ended before the step looked
    assert w.results(idle_wait=0.005)[0] == {"req-2"}
    assert w._wake.waits == []


def test_a_release_sets_the_wake_event():
    w = half()
    assert not w._wake.is_set()
    w._on_release("req-3", [4], "done")
    assert w._wake.is_set()
