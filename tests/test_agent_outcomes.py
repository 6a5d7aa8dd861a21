"""How a transfer ends, on both sides: a recv the sender failed has released its blocks
when its ``wait()`` returns; a send whose lease lapses while D is still unpacking what it
wrote agrees with D instead of reporting a failure D did not see, and where it cannot
wait any longer its error says how far the transfer got."""
from __future__ import annotations

import time

import pytest

from kvxfer import Agent, AgentConfig
from kvxfer.errors import InvalidDescriptor, KVXferError, TransferTimeout

from agent_procs import SECRET, make_pool
from deferred_device import DeferredDevice

T = 20.0


@pytest.mark.parametrize("senders", [1, 2])
def test_a_recv_the_sender_failed_has_freed_its_blocks_when_wait_returns(senders):
    """P fails the recv (it sends fewer blocks than D asked for). Right after ``wait()``
    raised, a recv on the same blocks must not find them busy: with one sender its FAIL
    says it is quiet; with a second connected peer that also holds the post, D waits for
    that one's answer before the handle fails."""
    d = Agent("d", secret=SECRET, backend="loopback")
    ps = [Agent(f"p{i}", secret=SECRET, backend="loopback") for i in range(senders)]
    try:
        d.register_kv(make_pool("2 N B H D", None))
        peers = []
        for p in ps:
            p.register_kv(make_pool("2 N B H D", 1))
            peers.append(p.connect(d.address))
        for i in range(10):
            hr = d.recv(f"L{i}", [3, 4, 5], timeout=T)
            hs = ps[0].send(peers[0], f"L{i}", [1, 2])  # two blocks for three: InvalidDescriptor both sides
            with pytest.raises(InvalidDescriptor):
                hr.wait(T)
            assert d.held_blocks() == {}
            again = d.recv(f"again{i}", [3, 4, 5], timeout=T)  # BlocksBusy here before the fix
            again.cancel()  # a cancel returns at once; its blocks follow once the peers answered
            with pytest.raises(InvalidDescriptor):
                hs.wait(T)
            for _ in range(2000):
                if not d.held_blocks():
                    break
                time.sleep(0.005)
            assert d.held_blocks() == {}
    finally:
        for a in (*ps, d):
            a.close()


def _pack_pair(p_lease: float, d_delay: float):
    cfg = AgentConfig(path="pack", staging_bytes=64 << 10)
    p = Agent("p", secret=SECRET, backend="loopback", config=cfg.replace(lease_timeout=p_lease))
    d = Agent("d", secret=SECRET, backend="loopback", config=cfg, device=DeferredDevice(d_delay))
    p.register_kv(make_pool("2 N B H D", 1))
    d.register_kv(make_pool("2 N B H D", None))
    return p, d, p.connect(d.address)


def test_unpack_acks_after_the_lease_both_sides_succeed():
    """Every chunk is written well inside P's lease, but D's unpack (deferred 1 s a chunk)
    acknowledges after it: P waits for the ACKs instead of failing a transfer D completes."""
    p, d, peer = _pack_pair(p_lease=0.5, d_delay=1.0)
    try:
        hr = d.recv("late", [3, 4], timeout=T)
        hs = p.send(peer, "late", [1, 2])
        hr.wait(T)
        hs.wait(T)  # TransferTimeout "expired before the receiver had it" before the fix
        assert hs.state == hr.state == "done"
        assert not p.held_blocks() and not d.held_blocks()
    finally:
        p.close()
        d.close()


def test_when_the_acks_never_come_the_error_says_every_piece_was_written():
    p, d, peer = _pack_pair(p_lease=0.3, d_delay=4.0)
    try:
        hr = d.recv("stuck", [3, 4], timeout=T)
        hs = p.send(peer, "stuck", [1, 2])
        with pytest.raises(TransferTimeout, match="after every piece was written"):
            hs.wait(T)
        with pytest.raises(KVXferError):  # D is told: both sides end failed
            hr.wait(T)
        assert not d.held_blocks()
    finally:
        p.close()
        d.close()
