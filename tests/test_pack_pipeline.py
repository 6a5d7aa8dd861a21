"""The pack path is a pipeline: chunk i+1 packs while chunk i is on the wire and D
unpacks chunk i-1. Checked by structure, not by time: P's writes complete only when the
test opens their gate, so a sequential pack path (pack, write, wait, next chunk) would
never pack a second chunk, nor would D unpack a first one, while the first (second)
write is held; the test waits for exactly that and fails after a timeout otherwise."""
from __future__ import annotations

import threading

import pytest
import torch

import kvxfer
from kvxfer import Agent, AgentConfig
from kvxfer.errors import TransferTimeout
from kvxfer.kernels.device import HostDevice
from kvxfer.transport.loopback import LoopbackBackend

from agent_procs import SECRET, make_pool

T = 20.0
STAGING = 8 << 10  # 4 KiB chunks of 1 KiB block-layers
SHAPE = {"L": 2, "N": 64}


class GatedWrites(LoopbackBackend):
    """Loopback whose write number k reports completion only once ``release(k)`` ran
    (the bytes move at post, as on a wire whose completion is late)."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self.posted: list = []  # request ids in post order
        self.released: set = set()

    def post(self, conn, op, descs):
        req = super().post(conn, op, descs)
        with self.cond:
            self.posted.append(req)
            self.cond.notify_all()
        return req

    def release(self, k: int) -> None:
        with self.cond:
            self.released.add(k)
            self.cond.notify_all()

    def wait(self, request_id: int, timeout: float) -> None:
        with self.cond:
            k = self.posted.index(request_id)
            if not self.cond.wait_for(lambda: k in self.released, timeout):
                raise TransferTimeout(f"write {k} held by the test")
        super().wait(request_id, timeout)

    def test(self, request_id: int) -> bool:
        with self.cond:
            if self.posted.index(request_id) not in self.released:
                return False
        return super().test(request_id)


class Counting(HostDevice):
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.packs = self.unpacks = 0

    def pack(self, *args, **kw):
        out = super().pack(*args, **kw)
        with self.cond:
            self.packs += 1
            self.cond.notify_all()
        return out

    def unpack(self, *args, **kw):
        out = super().unpack(*args, **kw)
        with self.cond:
            self.unpacks += 1
            self.cond.notify_all()
        return out

    def until(self, cond) -> bool:
        with self.cond:
            return self.cond.wait_for(cond, T)


def test_next_chunk_packs_and_previous_unpacks_while_a_write_is_on_the_wire():
    backend, p_dev, d_dev = GatedWrites(), Counting(), Counting()
    cfg = AgentConfig(path="pack", staging_bytes=STAGING)
    p = Agent("p", secret=SECRET, backend=backend, config=cfg, device=p_dev)
    d = Agent("d", secret=SECRET, backend="loopback", config=cfg, device=d_dev)
    try:
        src, dst = make_pool("2 N B H D", 1, shape=SHAPE), make_pool("2 N B H D", None, shape=SHAPE)
        p.register_kv(src)
        d.register_kv(dst)
        peer = p.connect(d.address)
        ids, to = list(range(0, 32, 2)), list(range(32, 48))  # 16 blocks x 2 layers = 8 chunks
        hr = d.recv("r", to, timeout=T)
        hs = p.send(peer, "r", ids)
        # write 0 is held: the next chunk is packed meanwhile
        assert p_dev.until(lambda: p_dev.packs >= 2), "chunk 1 was not packed while chunk 0 was on the wire"
        assert d_dev.unpacks == 0
        backend.release(0)
        # write 1 is held: D unpacks chunk 0 meanwhile, and P packs chunk 2
        assert d_dev.until(lambda: d_dev.unpacks >= 1), "chunk 0 was not unpacked while chunk 1 was on the wire"
        assert p_dev.until(lambda: p_dev.packs >= 3), "chunk 2 was not packed while chunk 1 was on the wire"
        for k in range(1, 8):
            backend.release(k)
        hs.wait(T)
        hr.wait(T)
        assert p_dev.packs == d_dev.unpacks == 8
        assert torch.equal(kvxfer.pack(src, ids, backend="reference"), kvxfer.pack(dst, to, backend="reference"))
        assert p._state.pool.stage_out.used_bytes == 0 and d._state.pool.stage_in.used_bytes == 0
    finally:
        for k in range(8):
            backend.release(k)
        p.close()
        d.close()


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_failed_chunk_releases_every_grant_and_slice(fail_at):
    """D's recv ends while chunk ``fail_at`` is held on the wire: P's send fails, both
    staging rings are empty again and D's blocks are released."""
    backend = GatedWrites()
    cfg = AgentConfig(path="pack", staging_bytes=STAGING)
    p = Agent("p", secret=SECRET, backend=backend, config=cfg)
    d = Agent("d", secret=SECRET, backend="loopback", config=cfg)
    try:
        p.register_kv(make_pool("2 N B H D", 1, shape=SHAPE))
        d.register_kv(make_pool("2 N B H D", None, shape=SHAPE))
        peer = p.connect(d.address)
        hr = d.recv("r", list(range(32, 48)), timeout=T)
        hs = p.send(peer, "r", list(range(0, 32, 2)))
        for k in range(fail_at):
            backend.release(k)
        with backend.cond:
            assert backend.cond.wait_for(lambda: len(backend.posted) > fail_at, T)
        hr.cancel()
        for k in range(8):
            backend.release(k)
        with pytest.raises(kvxfer.errors.KVXferError):
            hs.wait(T)
        deadline = threading.Event()
        for _ in range(500):
            if (not d.held_blocks() and not p.held_blocks() and p._state.pool.stage_out.used_bytes == 0
                    and d._state.pool.stage_in.used_bytes == 0):
                break
            deadline.wait(0.01)
        assert not d.held_blocks() and not p.held_blocks()
        assert p._state.pool.stage_out.used_bytes == 0 and d._state.pool.stage_in.used_bytes == 0
    finally:
        for k in range(8):
            backend.release(k)
        p.close()
        d.close()
