"""The connector's pool mover (``kvxfer.integrations.vllm.pool.PoolMover``) against a real
``kvxfer store`` node process, without engines: puts bounded (drops counted, never
waiting), held blocks released only after their puts ended, loads bitwise, a missing
key or a SIGKILLed node a failed load (reported, promptly), never a hang."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import kvxfer
from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.integrations.vllm.pool import PoolBlocks, PoolMover
from store_cases import SECRET, block_bits, make_layout, start_node, stop_node

DIMS = "N 2 H B D"  # vLLM CPU's per-(block, head) cells, as the connector describes them


@pytest.fixture
def node():
    proc, addr = start_node(capacity="4M", slot="64K")
    yield proc, addr
    stop_node(proc)


def _mover(addr, layout, put_blocks=64) -> PoolMover:
    cfg = ConnectorConfig(role="both", secret=SECRET, store=(addr,), store_put_blocks=put_blocks,
                          store_timeout=2.0)
    mover = PoolMover(cfg, threading.Event())
    mover.open(layout)
    return mover


def _drain(mover, want, timeout=30.0) -> tuple:
    """Call ``results`` until ``want(released, loaded, failed)`` (accumulated) holds."""
    released, loaded, failed = set(), set(), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, l, f = mover.results()
        released |= r
        loaded |= l
        failed |= f
        if want(released, loaded, failed):
            return released, loaded, failed
        time.sleep(0.02)
    raise AssertionError(f"not reached: released={released} loaded={loaded} failed={failed}")


def test_put_then_load_bitwise_bounded_and_held(node):
    _, addr = node
    src = make_layout(DIMS, 8, seed=1)
    dst = make_layout(DIMS, 8)
    keys = kvxfer.block_keys(range(6 * 4), 4, salt=b"pool-mover")
    put = _mover(addr, src, put_blocks=4)
    get = _mover(addr, dst)
    try:
        put.post_puts([PoolBlocks("r1", tuple(keys[:3]), (5, 1, 7)), PoolBlocks("r1", tuple(keys[3:6]), (0, 2, 3))])
        assert put.stats["store_put_drops"] == 3  # 3 in flight + 3 > store_put_blocks: dropped, not queued
        put.hold(["r1"])  # finished: its blocks wait for the put
        released, _, _ = _drain(put, lambda r, l, f: "r1" in r)
        assert released == {"r1"} and put.stats["store_put_blocks"] == 3 and not put.busy
        get.post_loads([PoolBlocks("q1", tuple(keys[:3]), (0, 4, 6))])
        _, loaded, failed = _drain(get, lambda r, l, f: "q1" in l)
        assert not failed and get.stats["store_load_blocks"] == 3
        for s, d in ((5, 0), (1, 4), (7, 6)):
            assert torch.equal(block_bits(src, s), block_bits(dst, d))
        # the dropped blocks were never put: loading them is a failed load, reported
        get.post_loads([PoolBlocks("q2", tuple(keys[:4]), (0, 1, 2, 3))])
        _, loaded, failed = _drain(get, lambda r, l, f: "q2" in l)
        assert failed == {"q2"} and get.stats["store_load_failed"] == 1
    finally:
        put.close()
        get.close()


def test_node_killed_fails_the_load_promptly(node):
    proc, addr = node
    src = make_layout(DIMS, 4, seed=2)
    keys = kvxfer.block_keys(range(2 * 4), 4, salt=b"pool-killed")
    mover = _mover(addr, src)
    try:
        mover.post_puts([PoolBlocks("r", tuple(keys), (0, 1))])
        _drain(mover, lambda r, l, f: not mover.busy)
        stop_node(proc, signal.SIGKILL)
        t0 = time.monotonic()
        mover.post_loads([PoolBlocks("q", tuple(keys), (2, 3))])
        _, loaded, failed = _drain(mover, lambda r, l, f: "q" in l, timeout=20.0)
        assert failed == {"q"} and time.monotonic() - t0 < 15.0
        mover.post_puts([PoolBlocks("r2", tuple(keys), (0, 1))])  # puts to a dead node end too
        _drain(mover, lambda r, l, f: not mover.busy, timeout=20.0)
    finally:
        mover.close()
