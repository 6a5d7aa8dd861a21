"""TransferHandle: states as an Enum, done callbacks (once, immediately when
already final, a raising callback is logged and harms nothing)."""
from __future__ import annotations

import logging
import threading

import pytest

import kvxfer
from kvxfer import Agent, HandleState
from kvxfer.errors import PeerDisconnected
from kvxfer.handle import TransferHandle

from agent_procs import SECRET, make_pool

T = 20.0


def test_states_are_an_enum_equal_to_their_names():
    h = TransferHandle("send", "r", None)
    assert h.state is HandleState.PENDING and h.state == "pending" and str(h.state) == "pending"
    h._fail(PeerDisconnected("gone"))
    assert h.state is HandleState.FAILED == "failed" and "failed" in repr(h)
    assert kvxfer.HandleState is HandleState and {s.value for s in HandleState} == {
        "pending", "done", "failed", "cancelled"}


def test_callback_runs_once_on_final_state_and_at_once_when_already_final():
    h = TransferHandle("recv", "r", None)
    calls = []
    h.add_done_callback(lambda x: calls.append(("a", x.state)))
    h.add_done_callback(lambda x: calls.append(("b", x.state)))
    assert calls == []
    assert h._succeed()
    assert not h._fail(PeerDisconnected("late"))  # final already: no second call
    assert calls == [("a", "done"), ("b", "done")]
    h.add_done_callback(lambda x: calls.append(("c", x.state)))  # already final: now, here
    assert calls[-1] == ("c", "done") and len(calls) == 3
    with pytest.raises(TypeError):
        h.add_done_callback(None)


def test_raising_callback_is_logged_and_others_still_run(caplog):
    h = TransferHandle("send", "r", None)
    seen = []

    def bad(_):
        raise RuntimeError("engine bug")

    h.add_done_callback(bad)
    h.add_done_callback(seen.append)
    with caplog.at_level(logging.ERROR, logger="kvxfer"):
        assert h.cancel()
    assert seen == [h] and h.state == HandleState.CANCELLED
    assert any("engine bug" in (r.exc_text or "") and r.levelno == logging.ERROR for r in caplog.records)


def test_callbacks_from_real_agents_done_and_timeout():
    p = Agent("p", secret=SECRET, backend="loopback")
    d = Agent("d", secret=SECRET, backend="loopback")
    try:
        p.register_kv(make_pool("2 N B H D", 1))
        d.register_kv(make_pool("N 2 H B D", None))
        peer = p.connect(d.address)
        events, fired = [], threading.Event()

        def note(h):
            events.append((h.kind, h.state))
            if len(events) == 3:
                fired.set()

        hr = d.recv("cb", [1, 2], timeout=T)
        hr.add_done_callback(note)
        hs = p.send(peer, "cb", [3, 4])
        hs.add_done_callback(note)
        d.recv("never", [5], timeout=0.2).add_done_callback(note)
        assert fired.wait(T)
        assert sorted(events) == [("recv", "done"), ("recv", "failed"), ("send", "done")]
        hr.wait(T)
        hs.wait(T)
    finally:
        p.close()
        d.close()
