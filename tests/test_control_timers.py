"""The I/O loop's cancellable timers, and what they buy: a finished request's book-keeping
is freed by reference counting at once, not held by its lease timer until the deadline
nor left in a reference cycle for the garbage collector."""
from __future__ import annotations

import gc
import socket
import threading
import weakref

import pytest

from kvxfer.agent.io_loop import IOLoop

from agent_procs import loopback_pair
from waiting import until

T = 20.0


@pytest.fixture
def loop():
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lp = IOLoop(lsock, lambda sock, addr: None, "timers")
    yield lp
    lp.stop()


def test_cancelled_timer_never_runs_and_drops_its_callback(loop):
    ran, fired = [], threading.Event()

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)
    doomed = loop.call_later(0.05, lambda p=payload: ran.append(p))
    loop.call_later(0.1, fired.set)
    del payload
    doomed.cancel()
    assert ref() is None  # dropped at cancel, not at the deadline
    assert fired.wait(T)
    assert ran == []


def test_cancelled_timers_are_compacted(loop):
    timers = [loop.call_later(3600.0, lambda: None) for _ in range(600)]
    for t in timers:
        t.cancel()
    keep = loop.call_later(3600.0, lambda: None)
    with loop._lock:
        assert len(loop._timers) == 1 and loop._timers[0][2] is keep


def test_finished_request_is_freed_without_the_collector():
    with loopback_pair() as (p, d, peer, _, _):
        refs = []
        gc.collect()
        gc.disable()
        try:
            for i in range(3):
                with p._state.lock, d._state.lock:  # (reentrant) nothing completes before the refs exist
                    hr = d.recv(f"r{i}", [1], timeout=60.0)
                    hs = p.send(peer, f"r{i}", [2])
                    refs += [weakref.ref(d._receiver.recvs[f"r{i}"]),
                             weakref.ref(p._sender.sends[(peer.serial, f"r{i}")])]
                hs.wait(T)
                hr.wait(T)
                del hr, hs
            # the I/O threads may still be unwinding the last completion
            until(lambda: all(r() is None for r in refs), "ops freed by reference counting", T, 0.01)
        finally:
            gc.enable()
        assert not p.held_blocks() and not d.held_blocks()
