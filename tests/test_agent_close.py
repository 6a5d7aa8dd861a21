"""Agent.close() always finishes, and frees the staging buffers at once."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import weakref

import pytest

from kvxfer import Agent, AgentConfig
from kvxfer.errors import KVXferError, RegistrationError, TransferTimeout
from kvxfer.transport.ucx import UcxBackend

from agent_procs import SECRET, make_pool
from idle_target import TCP, idle_agent

T = 60.0


class FailingClose(UcxBackend):
    """A backend whose close() fails (injected fault), twice in a row."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.num_close = 0

    def close(self) -> None:
        self.num_close += 1
        if self.num_close <= 2:
            raise OSError("injected: close failed")
        super().close()


def _agent_threads(name: str) -> list:
    return [t for t in threading.enumerate() if t.name.endswith(f"-{name}") and t.is_alive()]


def test_close_finishes_every_step_when_a_step_fails():
    released = []
    backend = FailingClose(allow_vm=False)
    agent = Agent("closing", secret=SECRET, backend=backend,
                  on_release=lambda req, ids, reason: released.append((req, reason)))
    agent.register_kv(make_pool("2 N B H D", None))
    handles = [agent.recv(f"r{i}", [i], timeout=T) for i in range(3)]
    stage = weakref.ref(agent._state.pool.stage_in_t)
    assert len(_agent_threads("closing")) == 3  # I/O, send and receive workers
    with pytest.raises(KVXferError, match="injected: close failed"):  # typed, once
        agent.close()
    # Every other step ran: handles failed, leases ended once, threads stopped, memory freed.
    assert all(h.state == "failed" for h in handles)
    assert sorted(released) == [(f"r{i}", "closed") for i in range(3)] and agent.held_blocks() == {}
    assert agent.closed and not _agent_threads("closing")
    assert agent._state.pool is None  # staging tensors and layout dropped
    del handles
    assert stage() is None
    agent.close()  # idempotent and silent: the backend is not asked again
    assert backend.num_close == 1
    backend.num_close = 2
    backend.close()  # (release the real engine)


def test_close_after_a_timed_out_ucx_write_finishes(monkeypatch):
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)
    layout = make_pool("2 N B H D", 2)
    with idle_agent("ucx") as (proc, _, address):
        p = Agent("p", secret=SECRET, backend="ucx", config=AgentConfig(lease_timeout=2.0))
        p.register_kv(layout)
        peer = p.connect(address)
        os.kill(proc.pid, signal.SIGSTOP)  # the target cannot serve the emulated RMA
        try:
            h = p.write(peer, list(range(16)), list(range(16)))
            with pytest.raises(TransferTimeout):
                h.wait(T)
            p.close()  # the transfer is still posted in UCX: close must cancel it, not give up
            assert p.closed and p._state.backend._engine.closed and p.held_blocks() == {}
            assert not _agent_threads("p")
            p.close()
        finally:
            os.kill(proc.pid, signal.SIGCONT)


def test_closed_agents_free_their_staging_buffers_without_the_cycle_collector():
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            p = Agent("p", secret=SECRET, config=AgentConfig(staging_bytes=4 << 20))
            d = Agent("d", secret=SECRET, config=AgentConfig(staging_bytes=4 << 20))
            p.register_kv(make_pool("2 N B H D", 1))
            d.register_kv(make_pool("2 N B H D", None))
            hr = d.recv("r", [3, 4], timeout=T)
            p.send(p.connect(d.address), "r", [1, 2]).wait(T)
            hr.wait(T)
            refs = [weakref.ref(t) for a in (p, d) for t in (a._state.pool.stage_in_t, a._state.pool.stage_out_t)]
            p.close()
            d.close()
            del p, d, hr
            # Handles and peers may still form cycles back to the agent; its buffers must not wait.
            assert all(r() is None for r in refs), "a closed agent still holds its staging buffers"
    finally:
        gc.enable()


def _race_round(rnd: int) -> list:
    """One round: threads call recv, send(peer) and send(None) on a connected pair while
    the main thread closes both agents. Returns the handles still pending once close()
    returned and the callers stopped (calls after close raise KVXferError)."""
    from agent_procs import loopback_pair

    handles: list = []
    started = threading.Barrier(4)

    def calls(make) -> None:
        started.wait(T)
        for i in range(32):
            try:
                handles.append(make(i))
            except KVXferError:  # the agent closed: every later call raises too
                return

    with loopback_pair() as (p, d, peer, src, dst):
        callers = [threading.Thread(target=calls, args=(fn,), daemon=True) for fn in (
            lambda i: d.recv(f"r{rnd}-{i}", [i], timeout=T),
            lambda i: p.send(peer, f"s{rnd}-{i}", [i]),
            lambda i: p.send(None, f"n{rnd}-{i}", [i]))]
        for t in callers:
            t.start()
        started.wait(T)
        for _ in range(rnd % 8):  # vary where in the callers' loops close() lands
            threading.Event().wait(0.0002)
        d.close()
        p.close()
        for t in callers:
            t.join(T)
            assert not t.is_alive(), "a call hung after close()"
        with pytest.raises(KVXferError, match="closed"):
            d.recv("after", [0], timeout=T)
        with pytest.raises(KVXferError, match="closed"):
            p.send(peer, "after", [0])
        return [h for h in handles if not h.done()]


def test_no_handle_pending_after_close_races_send_and_recv():
    """send()/recv() racing close() must not return a handle that never
    finishes. 200 rounds; every handle is final once close() returned."""
    pending = []
    for rnd in range(200):
        pending += _race_round(rnd)
    for h in pending:  # what they are, bounded
        with contextlib.suppress(Exception):
            h.wait(0.01)
    assert not pending, f"{len(pending)} handles pending after close in 200 rounds: {pending[:4]}"
