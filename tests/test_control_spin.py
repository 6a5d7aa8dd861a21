"""The I/O loop's bounded busy-polling (``AgentConfig.loop_spin_s``): validated, it runs
only after activity and only while ``spin_if()`` holds, a posted recv opens the window,
and once the window is over (or nothing is outstanding) the loop blocks in ``select``
without a timeout. No timing is asserted: a recording ``select`` says when it blocks."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from kvxfer import AgentConfig, _native
from kvxfer.agent.io_loop import IOLoop

from agent_procs import loopback_pair
from waiting import until

T = 20.0


# ---- configuration -------------------------------------------------------------------
def test_loop_spin_s_default_bounds_and_env():
    assert AgentConfig().loop_spin_s == 0.002
    assert AgentConfig(loop_spin_s=0).loop_spin_s == 0
    assert AgentConfig(loop_spin_s=0.01).loop_spin_s == 0.01
    for bad in (-1e-6, 0.0101, float("nan"), True, "0.001", None):
        with pytest.raises(ValueError, match="loop_spin_s"):
            AgentConfig(loop_spin_s=bad)
    assert AgentConfig.from_env({"KVXFER_LOOP_SPIN_S": "0"}).loop_spin_s == 0.0
    assert AgentConfig.from_env({"KVXFER_LOOP_SPIN_S": "0.0005"}).loop_spin_s == 0.0005
    with pytest.raises(ValueError, match="KVXFER_LOOP_SPIN_S"):
        AgentConfig.from_env({"KVXFER_LOOP_SPIN_S": "fast"})
    with pytest.raises(ValueError, match="loop_spin_s"):
        AgentConfig.from_env({"KVXFER_LOOP_SPIN_S": "1"})


# ---- the native poll ---------------------------------------------------------------------
def test_spin_readable_sees_data_and_gives_up():
    spin = _native.load().spin_readable
    a, b = socket.socketpair()
    try:
        assert spin(a.fileno(), 1_000_000) == 0  # nothing came within 1 ms
        assert spin(a.fileno(), 10 * 10**9, 1) == -1  # any yield takes over 1 ns: "contended"
        b.send(b"x")
        assert spin(a.fileno(), 10 * 10**9) == 1  # returns as soon as it is readable
        assert spin(-1, 1_000_000) == 0
    finally:
        a.close()
        b.close()


# ---- the loop ----------------------------------------------------------------------------
class Recorder:
    """Wraps a loop's ``select`` and native poll and logs their calls in order:
    ``("select", timeout)``, ``("spin", ns, ready)``, ``("mark",)``. ``before_spin`` runs
    in the loop thread just before a poll (to make data arrive during one). ``contended``:
    every poll reports a yield that took too long; otherwise no poll does (the polls run
    with contention detection off), so how busy the machine is never decides which path
    a test takes."""

    def __init__(self, loop: IOLoop, before_spin=None, contended=False) -> None:
        self.log = []
        self.cond = threading.Condition()
        real_select, real_spin = loop._sel.select, loop._spin_readable
        self._loop = loop

        def select(timeout=None):
            self._add(("select", timeout))
            return real_select(timeout)

        def spin(fd, ns, contended_ns=0):
            if before_spin is not None:
                before_spin()
            ready = real_spin(fd, ns, 1 if contended else 0)
            self._add(("spin", ns, ready))
            return ready

        loop._sel.select = select
        if real_spin is not None:
            loop._spin_readable = spin

    def _add(self, entry) -> None:
        with self.cond:
            self.log.append(entry)
            self.cond.notify_all()

    def mark(self) -> int:
        """Log a mark from the loop thread (an event for the loop); its index."""
        with self.cond:
            n = len(self.log)
        self._loop.call_soon(lambda: self._add(("mark",)))
        with self.cond:
            assert self.cond.wait_for(lambda: ("mark",) in self.log[n:], T), "the loop never ran"
            return self.log.index(("mark",), n)

    def blocked_after(self, i: int) -> list:
        """Wait for a blocking ``select`` (no timeout, or until a timer) logged after index
        ``i``; the log from ``i`` up to it."""
        def blocking(e) -> bool:
            return e[0] == "select" and (e[1] is None or e[1] > 0)

        def found():
            return next((k for k in range(i + 1, len(self.log)) if blocking(self.log[k])), None)

        with self.cond:
            assert self.cond.wait_for(lambda: found() is not None, T), "the loop never blocked"
            return self.log[i:found() + 1]

    @staticmethod
    def spins(entries) -> list:
        return [e for e in entries if e[0] == "spin"]


def make_loop(spin_s: float, outstanding) -> IOLoop:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    return IOLoop(lsock, lambda sock, addr: None, "spin", spin_s=spin_s, spin_if=lambda: outstanding[0])


@pytest.mark.parametrize("spin_s", [0.001, 0.0])
def test_idle_loop_blocks_without_polling(spin_s):
    outstanding = [False]  # activity, but nothing outstanding: no poll window
    loop = make_loop(spin_s, outstanding)
    try:
        rec = Recorder(loop)
        assert (loop._spin_readable is None) == (spin_s == 0)  # no native poll without a window
        i = rec.mark()
        loop.kick()
        i = rec.mark()
        assert Recorder.spins(rec.blocked_after(i)) == []
        assert Recorder.spins(rec.log) == []
    finally:
        loop.stop()


def test_window_after_activity_polls_then_blocks():
    outstanding = [False]
    loop = make_loop(0.002, outstanding)
    try:
        rec = Recorder(loop)
        rec.blocked_after(rec.mark())
        outstanding[0] = True
        i = rec.mark()  # an event opens the window...
        seen = rec.blocked_after(i)  # ...and once it is over, the loop blocks again
        spins = Recorder.spins(seen)
        assert spins and all(0 < ns <= 2_000_000 for _, ns, _ in spins)
        assert spins[-1][2] == 0  # the last poll ran out: nothing came

        i = len(rec.log)
        loop.kick()  # a request went out: the window opens again
        assert Recorder.spins(rec.blocked_after(i))
    finally:
        loop.stop()


def test_contended_cpu_stops_polling():
    outstanding = [True]
    loop = make_loop(0.002, outstanding)
    try:
        rec = Recorder(loop, contended=True)  # every poll reports a yield that took too long
        seen = rec.blocked_after(rec.mark())
        assert [e[2] for e in Recorder.spins(seen)] == [-1]  # one poll, then it blocked
        loop._spin_off_until = float("inf")  # (the back-off, made long for the test)
        i = rec.mark()
        loop.kick()
        assert Recorder.spins(rec.blocked_after(rec.mark())) == []
        assert Recorder.spins(rec.log[i:]) == []
    finally:
        loop.stop()


def test_poll_picks_up_a_message_in_the_window():
    outstanding = [True]
    loop = make_loop(0.01, outstanding)
    a, b = socket.socketpair()
    got = threading.Event()

    def readable():
        a.recv(16)
        got.set()

    try:
        sent = []

        def send_once():  # the peer's reply lands while the loop polls
            if not sent:
                sent.append(b.send(b"x"))

        rec = Recorder(loop, before_spin=send_once)
        loop.add_reader(a.fileno(), readable)
        rec.mark()
        assert got.wait(T)
        assert ("spin", 1) in [(e[0], e[2]) for e in Recorder.spins(rec.log)]
    finally:
        loop.stop()
        a.close()
        b.close()


# ---- the agent ------------------------------------------------------------------------------
@pytest.mark.parametrize("spin_s", [0.0, 0.01])
def test_agents_move_bytes_and_go_idle(spin_s):
    with loopback_pair(AgentConfig(loop_spin_s=spin_s)) as (p, d, peer, src, dst):
        assert (p._state.loop._spin_ns > 0) == (d._state.loop._spin_ns > 0) == (spin_s > 0)
        recs = [Recorder(a._state.loop) for a in (p, d)]
        for i in range(3):
            hs = p.send(peer, f"r{i}", [2])
            d.recv(f"r{i}", [1 + i], timeout=T).wait(T)
            hs.wait(T)
            for layer_src, layer_dst in zip(src.tensors, dst.tensors):
                assert torch.equal(layer_src[:, 2], layer_dst[:, 1 + i])
        assert bool(Recorder.spins(recs[1].log)) == (spin_s > 0)  # D polled for its replies
        until(lambda: not d._receiver.busy() and not p._sender.sends, "idle agents", T, 0.01)
        for rec in recs:  # nothing outstanding: an event opens no window
            assert Recorder.spins(rec.blocked_after(rec.mark())) == []


def test_no_polling_while_a_bulk_copy_wants_the_cores(monkeypatch):
    import kvxfer.agent.receiver as receiver
    from kvxfer.agent.threads import Worker

    w = Worker("spin-test")
    release = threading.Event()
    try:
        assert w.idle()
        w.submit(lambda: release.wait(T))
        assert not w.idle()  # a copy job queued or running
    finally:
        release.set()
        until(w.idle, "the worker idle again", T, 0.01)
        w.stop()

    with loopback_pair() as (p, d, peer, _, _):
        assert not d._spin_if() and not p._spin_if()  # nothing outstanding
        h = d.recv("small", [1], timeout=T)
        assert d._spin_if()  # a small recv: its reply comes within a window
        hs = p.send(peer, "small", [2])
        h.wait(T)
        hs.wait(T)
        monkeypatch.setattr(receiver, "INLINE_BYTES", 0)  # every recv is bulk now
        rec = Recorder(d._state.loop)
        i = rec.mark()
        h = d.recv("bulk", [1], timeout=T)  # nor does an event: the loop does not poll
        assert d._receiver.bulk_pending() and not d._spin_if()  # a sender copies it with its pool
        assert Recorder.spins(rec.blocked_after(i)) == []
        h.cancel()
