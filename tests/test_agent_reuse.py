"""Requests that do not fit together fail both sides at once,
and a request id can be reused once its previous handle finished, whichever
side comes first (item 8)."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

import kvxfer
from kvxfer import Agent
from kvxfer.errors import InvalidDescriptor, TransferCancelled, TransferTimeout

import agent_procs
from agent_procs import SECRET, make_pool

T = 20.0


@pytest.fixture
def pair():
    p = Agent("p", secret=SECRET, backend="loopback")
    d = Agent("d", secret=SECRET, backend="loopback")
    p.register_kv(make_pool("2 N B H D", 1))
    d.register_kv(make_pool("N 2 H B D", None))
    peer = p.connect(d.address)
    for _ in range(2000):  # D posts recvs only to peers it registered
        if d.peers():
            break
        time.sleep(0.005)
    yield p, d, peer
    p.close()
    d.close()


def _same(p, src, d, dst):
    return torch.equal(kvxfer.pack(p._state.layout, src, backend="reference"),
                       kvxfer.pack(d._state.layout, dst, backend="reference"))


@pytest.mark.parametrize("recv_first", [True, False])
def test_block_count_mismatch_fails_both_sides_at_once(pair, recv_first):
    p, d, peer = pair
    t0 = time.monotonic()
    if recv_first:
        hr = d.recv("m", [1, 2], timeout=300.0)
        hs = p.send(peer, "m", [3, 4, 5])
    else:
        hs = p.send(peer, "m", [3, 4, 5])
        hr = d.recv("m", [1, 2], timeout=300.0)
    with pytest.raises(InvalidDescriptor):
        hs.wait(T)
    with pytest.raises(InvalidDescriptor):
        hr.wait(T)  # not D's 300 s timeout
    assert time.monotonic() - t0 < T
    for _ in range(1000):
        if not p.held_blocks() and not d.held_blocks():
            break
        time.sleep(0.01)
    assert not p.held_blocks() and not d.held_blocks()


def test_block_count_mismatch_between_processes():
    ctx = mp.get_context("spawn")
    d = Agent("d", secret=SECRET)
    q = ctx.Queue()
    proc = ctx.Process(target=agent_procs.prefill, args=(d.address, ["m"], [3, 4, 5], q), daemon=True)
    try:
        d.register_kv(make_pool("N 2 H B D", None))
        hr = d.recv("m", [1, 2], timeout=600.0)
        proc.start()
        with pytest.raises(InvalidDescriptor):
            hr.wait(300.0)  # P is a spawned process: on a loaded machine it may take a minute to start
        status, info = q.get(timeout=90.0)
        assert status == "err" and info.startswith("InvalidDescriptor"), info
    finally:
        d.close()
        proc.join(T)
        if proc.is_alive():
            proc.kill()
            proc.join(T)


def _wait_tombstone(p, peer, req):
    for _ in range(2000):
        if req in peer.book.tombstones:
            return
        time.sleep(0.005)
    raise AssertionError("the CANCEL never reached P")


def test_reuse_after_recv_timeout_sender_first(pair):
    p, d, peer = pair
    old = d.recv("again", [1, 2], timeout=0.2)
    with pytest.raises(TransferTimeout):
        old.wait(T)
    _wait_tombstone(p, peer, "again")  # P heard that D gave up on the first recv
    hs = p.send(peer, "again", [7, 8])  # the new request's sender comes first
    time.sleep(0.2)
    hr = d.recv("again", [3, 4], timeout=T)
    hs.wait(T)
    hr.wait(T)
    assert _same(p, [7, 8], d, [3, 4])


def test_reuse_after_recv_timeout_receiver_first(pair):
    p, d, peer = pair
    old = d.recv("again2", [1, 2], timeout=0.2)
    with pytest.raises(TransferTimeout):
        old.wait(T)
    _wait_tombstone(p, peer, "again2")
    hr = d.recv("again2", [3, 4], timeout=T)
    hs = p.send(peer, "again2", [7, 8])
    hs.wait(T)
    hr.wait(T)
    assert _same(p, [7, 8], d, [3, 4])


def test_late_send_for_a_cancelled_recv_still_fails(pair):
    p, d, peer = pair
    d.recv("gone", [1], timeout=T).cancel()
    _wait_tombstone(p, peer, "gone")
    hs = p.send(peer, "gone", [2])
    with pytest.raises(TransferCancelled):
        hs.wait(T)  # after the grace for a reused id, well before the 30 s lease
    assert not p.held_blocks()
