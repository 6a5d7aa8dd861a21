"""The connector's worker half sleeps through an idle engine step while transfers are in
flight (so vLLM's empty steps do not spin a core the copy needs), on the event the
agent's release callback sets, and never sleeps when nothing is in flight or an end is
already queued. No vLLM needed: the half is driven directly, as the connector drives it,
with its wake event replaced by one that records each wait (no timing in the test)."""
from __future__ import annotations

from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.integrations.vllm.meta import SendSpec
from kvxfer.integrations.vllm.outbound import Outbound
from kvxfer.integrations.vllm.worker import WorkerHalf


class Handle:  # what results() reads of a finished send handle (matched by a TP 1 D)
    state, nbytes, created, finished, request_id, path, peer = "done", 4096, 1.0, 1.5, "r", "vm", "d"

    def done(self) -> bool:
        return True


def in_flight(w: WorkerHalf, req: str) -> None:
    """A send of ``req`` whose data is visible in D but whose lease is not released yet."""
    ob = Outbound(SendSpec(req, (1,)), (0, 1), 1, 30.0)
    ob.active[None], ob.leases = Handle(), 1
    w._out[req] = w._by_wire[req] = ob


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
    in_flight(w, "req-1")
    w._wake = RecordingEvent(w, arrives="req-1")
    assert w.results(idle_wait=0.005, finished_req_ids={"req-1"}) == ({"req-1"}, set(), set())
    assert w._wake.waits == [0.005]


def test_idle_wait_with_no_end_leaves_the_transfer_in_flight():
    w = half()
    in_flight(w, "req-1")
    w._wake = RecordingEvent(w)
    assert w.results(idle_wait=0.005, finished_req_ids={"req-1"}) == (set(), set(), set())
    assert w._wake.waits == [0.005] and "req-1" in w._out  # reported by a later step


def test_no_wait_without_transfers_in_flight_with_an_end_queued_or_in_a_busy_step():
    w = half()
    w._wake = RecordingEvent(w)
    assert w.results(idle_wait=0.005) == (set(), set(), set())  # nothing in flight
    in_flight(w, "req-2")
    assert w.results(idle_wait=0.0, finished_req_ids={"req-2"}) == (set(), set(), set())  # the step had work
    w._on_release("req-2", [3], "done")  # ended before the step looked
    assert w.results(idle_wait=0.005)[0] == {"req-2"}
    assert w._wake.waits == []


def test_a_send_is_reported_only_once_vllm_finished_the_request():
    """A layer-by-layer send can end before the request finishes (vLLM frees the blocks
    of any request named in finished_sending): the report waits for finished_req_ids."""
    w = half()
    in_flight(w, "req-4")
    w._on_release("req-4", [1], "done")
    assert w.results()[0] == set()
    assert w.results(finished_req_ids={"req-4"})[0] == {"req-4"}
    assert "req-4" not in w._out


def test_a_release_sets_the_wake_event():
    w = half()
    assert not w._wake.is_set()
    w._on_release("req-3", [4], "done")
    assert w._wake.is_set()
