"""Pack transfers larger than the staging ring: completion is tracked per
(layer, head range, block) chunk, so a recv is done only once every chunk
landed. A small ``staging_bytes`` keeps the requests small:
with 1 KiB block-layers and an 8 KiB ring (4 KiB chunks), 2x and 5x the ring
split each layer across several chunks."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import kvxfer
from kvxfer import Agent, AgentConfig

import agent_procs
from agent_procs import SECRET, make_pool

T = 30.0
STAGING = 8 << 10
PACK = AgentConfig(path="pack", staging_bytes=STAGING)
SHAPE = {"L": 2, "N": 64}  # block_nbytes = 2 * 4 * 4 * 16 * 2 B = 1 KiB per block-layer


def _blocks(multiple: int) -> int:
    """Blocks per request of ``multiple`` x the staging size (all layers)."""
    return multiple * STAGING // (1024 * SHAPE["L"])


def _check(src_layout, src, dst_layout, dst):
    for s, d in zip(src, dst):  # every destination block, bitwise
        assert torch.equal(kvxfer.pack(src_layout, [s], backend="reference"),
                           kvxfer.pack(dst_layout, [d], backend="reference")), f"block {d}"
    others = [b for b in range(dst_layout.num_blocks) if b not in dst]
    assert not kvxfer.pack(dst_layout, others, backend="reference").any()


@pytest.mark.parametrize("multiple", [1, 2, 5])
@pytest.mark.parametrize("p_dims,d_dims", [("2 N B H D", "N 2 H B D"), ("N 2 H B D", "2 N B H D")])
def test_pack_requests_larger_than_staging_are_complete(multiple, p_dims, d_dims):
    pl = make_pool(p_dims, 1, shape=SHAPE)
    dl = make_pool(d_dims, None, shape=SHAPE)
    p = Agent("p", secret=SECRET, backend="loopback", config=PACK)
    d = Agent("d", secret=SECRET, backend="loopback", config=PACK)
    try:
        p.register_kv(pl)
        d.register_kv(dl)
        peer = p.connect(d.address)
        n = _blocks(multiple)
        src = [(7 * i + 3) % 64 for i in range(n)]
        dst = list(range(63, 63 - n, -1))
        hr = d.recv("big", dst, timeout=T)
        hs = p.send(peer, "big", src)
        hs.wait(T)
        hr.wait(T)
        assert hs.path == hr.path == "pack"
        assert hr.nbytes == hs.nbytes == dl.wire_nbytes(n)
        _check(pl, src, dl, dst)
        assert d._state.pool.stage_in.used_bytes == 0 and not d.held_blocks() and not p.held_blocks()
    finally:
        p.close()
        d.close()


def test_pack_5x_staging_between_processes():
    """The same across two processes over the default backend, NHD -> HND."""
    ctx = mp.get_context("spawn")
    dl = make_pool("N 2 H B D", None, shape=SHAPE)
    d = Agent("d", secret=SECRET, config=PACK)
    n = _blocks(5)
    src, dst = list(range(n)), list(range(2 * n, n, -1))
    q = ctx.Queue()
    proc = ctx.Process(target=agent_procs.prefill, args=(d.address, ["x5"], src, q), daemon=True,
                       kwargs=dict(path="pack", shape=SHAPE, staging_bytes=STAGING))
    try:
        d.register_kv(dl)
        h = d.recv("x5", dst, timeout=2 * T)
        proc.start()
        h.wait(2 * T)
        status, info = q.get(timeout=2 * T)
        assert status == "ok" and info["paths"] == ["pack"], info
        _check(make_pool("2 N B H D", 1, shape=SHAPE), src, dl, dst)
    finally:
        d.close()
        proc.join(T)
        if proc.is_alive():
            proc.kill()
            proc.join(T)
