"""Real processes (multiprocessing spawn) over the default backend: bitwise
equality across layouts, tp=2 -> 1 with two prefill processes, and a prefill
process SIGKILLed in the middle of a streamed request."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

import kvxfer
from kvxfer import Agent
from kvxfer.errors import BlocksBusy, PeerDisconnected

import agent_procs
from agent_procs import SECRET, make_pool

T = 60.0  # spawning a child that imports torch takes seconds on a busy machine
CTX = mp.get_context("spawn")


def _start(*args, **kwargs):
    q = CTX.Queue()
    proc = CTX.Process(target=agent_procs.prefill, args=(*args[:3], q), kwargs=kwargs, daemon=True)
    proc.start()
    return proc, q


def _stop(procs):
    for p in procs:
        p.join(T)
        if p.is_alive():
            p.kill()
            p.join(T)


def test_two_processes_nhd_to_hnd_bitwise_either_order():
    d_layout = make_pool("N 2 H B D", None)
    d = Agent("d", secret=SECRET)
    procs = []
    try:
        d.register_kv(d_layout)
        first = d.recv("a", [0, 7, 2, 30], timeout=T)  # recv before the sender exists
        proc, q = _start(d.address, ["a", "b"], [5, 3, 9, 1])
        procs.append(proc)
        first.wait(T)
        second = d.recv("b", [4, 6, 8, 10], timeout=T)  # the sender posted "b" long ago
        second.wait(T)
        status, info = q.get(timeout=T)
        assert status == "ok", info
        p_layout = make_pool("2 N B H D", 1)
        expect = kvxfer.pack(p_layout, [5, 3, 9, 1], backend="reference")
        assert torch.equal(expect, kvxfer.pack(d_layout, [0, 7, 2, 30], backend="reference"))
        assert torch.equal(expect, kvxfer.pack(d_layout, [4, 6, 8, 10], backend="reference"))
        assert info["transport"] in d.metrics.to_dict()["info"].values()
    finally:
        d.close()
        _stop(procs)


def test_tp2_prefill_processes_feed_one_decode():
    d_layout = make_pool("2 N B H D", None, dtype="bfloat16")
    d = Agent("d", secret=SECRET)
    procs = []
    try:
        d.register_kv(d_layout)
        h = d.recv("r", [3, 1, 4], timeout=T)
        queues = []
        for rank in range(2):
            proc, q = _start(d.address, ["r"], [10, 11, 12], tp_rank=rank, tp_size=2, seed=20 + rank,
                             dims="N 2 H B D", dtype="bfloat16", path="pack" if rank else "zero_copy")
            procs.append(proc)
            queues.append(q)
        h.wait(T)
        for rank, q in enumerate(queues):
            status, info = q.get(timeout=T)
            assert status == "ok", info
            src = make_pool("N 2 H B D", 20 + rank, dtype="bfloat16", tp_rank=rank, tp_size=2)
            assert torch.equal(kvxfer.pack(src, [10, 11, 12], backend="reference"),
                               kvxfer.pack(d_layout, [3, 1, 4], heads=(2 * rank, 2 * rank + 2),
                                           backend="reference"))
    finally:
        d.close()
        _stop(procs)


def test_overlapping_recv_refused_and_no_block_holds_another_requests_bytes():
    """``recv("c2", [6, 7])`` while ``recv("c1", [5, 6])`` is pending
    used to be accepted, and c1's block 6 then held c2's bytes."""
    d_layout = make_pool("2 N B H D", None)
    d = Agent("d", secret=SECRET)
    procs = []
    try:
        d.register_kv(d_layout)
        c1 = d.recv("c1", [5, 6], timeout=T)
        try:
            c2 = d.recv("c2", [6, 7], timeout=T)
        except BlocksBusy as exc:
            assert "'c1'" in str(exc)
            c2 = None
        refused_held = d.held_blocks()
        proc, q = _start(d.address, ["c1", "c2"], {"c1": [1, 2], "c2": [3, 4]})
        procs.append(proc)
        c1.wait(T)
        p_layout = make_pool("2 N B H D", 1)
        got_c1 = kvxfer.pack(d_layout, [5, 6], backend="reference")
        assert torch.equal(got_c1, kvxfer.pack(p_layout, [1, 2], backend="reference")), "c1's blocks hold other bytes"
        assert c2 is None and refused_held == {"c1": (5, 6)}, "the overlapping recv was accepted"
        c2 = d.recv("c2", [6, 7], timeout=T)  # block 6 is free again once c1 is done
        c2.wait(T)
        status, info = q.get(timeout=T)
        assert status == "ok", info
        assert torch.equal(kvxfer.pack(d_layout, [6, 7], backend="reference"),
                           kvxfer.pack(p_layout, [3, 4], backend="reference"))
        assert d.held_blocks() == {}
    finally:
        d.close()
        _stop(procs)


def test_sigkill_mid_transfer_fails_with_peer_disconnected():
    released = []
    d = Agent("d", secret=SECRET, on_release=lambda r, b, why: released.append((r, why)))
    procs = []
    try:
        d.register_kv(make_pool("2 N B H D", None))
        h = d.recv("k", [1, 2], timeout=T)
        proc, q = _start(d.address, ["k"], [3, 4], stream_then_hang=True)
        procs.append(proc)
        h.wait(T, layer=0)  # layer 0 landed; the sender now "computes" forever
        status, pid = q.get(timeout=T)
        assert status == "streamed"
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(PeerDisconnected):
            h.wait(T)
        assert not h.done() or h.state == "failed"
        assert released == [("k", "failed")] and d.held_blocks() == {}
    finally:
        d.close()
        _stop(procs)


def test_ucx_over_tcp_between_processes(monkeypatch):
    """UCX RMA over TCP completes only if the target progresses; the agent does it."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    d_layout = make_pool("2 N B H D", None)
    d = Agent("d", secret=SECRET, backend="ucx")
    procs = []
    try:
        d.register_kv(d_layout)
        h = d.recv("u", [6, 2], timeout=T)
        proc, q = _start(d.address, ["u"], [1, 9], backend="ucx")
        procs.append(proc)
        h.wait(T)
        status, info = q.get(timeout=T)
        assert status == "ok", info
        assert info["transport"].startswith("ucx:tcp")
        assert torch.equal(kvxfer.pack(make_pool("2 N B H D", 1), [1, 9], backend="reference"),
                           kvxfer.pack(d_layout, [6, 2], backend="reference"))
    finally:
        d.close()
        _stop(procs)


def test_64_concurrent_requests_between_processes():
    d_layout = make_pool("2 N B H D", None, shape={"N": 160})
    d = Agent("d", secret=SECRET)
    procs = []
    try:
        d.register_kv(d_layout)
        reqs = [f"c{i}" for i in range(64)]
        early = [d.recv(r, [2 * i, 2 * i + 1], timeout=T) for i, r in enumerate(reqs[:32])]
        proc, q = _start(d.address, reqs, [7, 3])  # P sends all 64 at once, then waits
        procs.append(proc)
        late = [d.recv(r, [64 + 2 * i, 65 + 2 * i], timeout=T) for i, r in enumerate(reqs[32:])]
        for h in early + late:
            h.wait(T)
        status, info = q.get(timeout=T)
        assert status == "ok", info
        expect = kvxfer.pack(make_pool("2 N B H D", 1), [7, 3], backend="reference")
        for i in range(64):
            assert torch.equal(expect, kvxfer.pack(d_layout, [2 * i, 2 * i + 1], backend="reference"))
        assert d.held_blocks() == {} and d.metrics.counter("transfers", kind="recv") == 64
    finally:
        d.close()
        _stop(procs)
