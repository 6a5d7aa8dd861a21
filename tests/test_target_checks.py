"""The memory owner checks every range over UCX's emulated RMA.

An authenticated peer that forges the metadata it was given (its copy of the
target's region grown by 256 KiB on each side) passes its own validation; over
UCX/TCP the *target* must still refuse every byte outside what it registered,
for writes and reads of any size, and keep serving honest ranges.
"""
from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest

from kvxfer import AgentConfig
from kvxfer.errors import InvalidDescriptor
from kvxfer.transport import make_backend

import transport_peer

POOL = 1 << 20
GUARD = 256 << 10
TCP = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}
T = 30.0


def _fnv1a(data: bytes) -> int:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & (2**64 - 1)
    return h


def widen_region(meta: bytes, region_id: int, by: int) -> bytes:
    """``meta`` (docs/registration.md layout) with one region grown by ``by`` bytes on
    each side, checksum recomputed: what a malicious peer could hand its own engine."""
    body = bytearray(meta[:-8])
    pos = 4 + 2 + 8 + 4

    def skip_str(p):
        return p + 4 + struct.unpack_from("<I", body, p)[0]

    pos = skip_str(skip_str(pos))  # hostname, boot id
    pos += 8 * 3  # pid namespace, probe address, probe length
    pos = skip_str(skip_str(pos))  # probe token, worker address
    (count,) = struct.unpack_from("<I", body, pos)
    pos += 4
    for _ in range(count):
        rid, addr, length = struct.unpack_from("<QQQ", body, pos)
        if rid == region_id:
            struct.pack_into("<QQ", body, pos + 8, addr - by, length + 2 * by)
        pos = skip_str(pos + 8 * 3 + 4)  # id, addr, length, kind, rkey
        (pieces,) = struct.unpack_from("<I", body, pos + 8)  # shared memory: offset, pieces (fd, ino, size)
        pos += 8 + 4 + pieces * (4 + 8 + 8)
    assert pos == len(body)
    return bytes(body) + struct.pack("<Q", _fnv1a(bytes(body)))


@contextlib.contextmanager
def guarded_target(pool_bytes: int = POOL):
    with transport_peer.spawned(pool_bytes, TCP, guard_bytes=GUARD) as (_, pipe, meta, rid):
        yield pipe, meta, rid


def _ask(pipe, cmd):
    return transport_peer.ask(pipe, cmd, T)


@pytest.fixture
def tcp_initiator(monkeypatch):
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)  # read by UCX when the engine is created
    b = make_backend("ucx")
    yield b
    b.close()


# (remote offset in the forged region, length): the region starts GUARD bytes before the pool.
OUTSIDE = [(0, GUARD), (GUARD + POOL, GUARD), (GUARD - 4096, 8192), (0, 4096), (GUARD + POOL - 100, 200)]


def test_tcp_target_refuses_forged_ranges_outside_its_pool(tcp_initiator):
    b = tcp_initiator
    src = np.full(GUARD, 0x5A, np.uint8)
    dst = np.zeros(GUARD, np.uint8)
    with guarded_target() as (pipe, meta, rid):
        ls, ld = b.register(src.ctypes.data, src.nbytes), b.register(dst.ctypes.data, dst.nbytes)
        conn = b.connect(widen_region(meta, rid, GUARD))
        assert conn.transport.startswith("ucx:tcp")
        assert conn.remote_regions[rid][1] == POOL + 2 * GUARD  # our engine believes the forgery
        for off, n in OUTSIDE:
            for op, local in (("write", ls), ("read", ld)):
                with pytest.raises(InvalidDescriptor, match="refused"):
                    b.wait(b.post(conn, op, [[local, 0, rid, off, n]]), T)
        assert not dst.any(), "bytes outside the pool were read"
        assert _ask(pipe, "guards") == bytes([0xA5]) * (2 * GUARD), "bytes outside the pool were written"
        assert not np.frombuffer(_ask(pipe, "bytes"), np.uint8).any()
        assert _ask(pipe, "rejected") == 2 * len(OUTSIDE)
        # The same connection still moves honest ranges, large and small, both ways.
        rows = [[ls, 0, rid, GUARD, 200_000], [ls, 200_000, rid, GUARD + 300_000, 3000]]
        b.wait(b.post(conn, "write", rows), T)
        pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        assert (pool[:200_000] == 0x5A).all() and (pool[300_000:303_000] == 0x5A).all()
        assert int(np.count_nonzero(pool)) == 203_000
        b.wait(b.post(conn, "read", [[ld, 0, rid, GUARD + 100_000, 150_000]]), T)
        assert (dst[:100_000] == 0x5A).all() and not dst[100_000:150_000].any()


def test_tcp_large_and_many_runs_cross_message_limits_bitwise(tcp_initiator):
    # 20,000 runs (more entries than one message holds) and one 3 MiB run (more bytes).
    b = tcp_initiator
    size = 4 << 20
    src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    with guarded_target(size) as (pipe, meta, rid):
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        n, big = 20_000, (3 << 20) + 7
        i = np.arange(n, dtype=np.int64)
        small = np.stack([np.full(n, ls), i * 20, np.full(n, rid), i * 40, np.full(n, 20)], axis=1)
        rows = np.concatenate([small, [[ls, 400_000, rid, (1 << 20) - 100, big]]])
        b.wait(b.post(conn, "write", rows), T)
        expect = np.zeros(size, np.uint8)
        expect[: n * 40].reshape(n, 40)[:, :20] = src[: n * 20].reshape(n, 20)
        expect[(1 << 20) - 100 : (1 << 20) - 100 + big] = src[400_000 : 400_000 + big]
        assert np.array_equal(np.frombuffer(_ask(pipe, "bytes"), np.uint8), expect)
        out = np.zeros(size + 5, np.uint8)
        lo = b.register(out.ctypes.data, out.nbytes)
        b.wait(b.post(conn, "read", [[lo, 5, rid, 0, size]]), T)
        assert np.array_equal(out[5:], expect) and not out[:5].any()
        assert _ask(pipe, "rejected") == 0


def test_tcp_rendezvous_messages_of_many_runs_are_checked_whole(monkeypatch):
    # 256 runs of 4 KiB: one 1 MiB message whose table rides in the rendezvous
    # header; the target checks it before it accepts a byte. One forged run in
    # the middle refuses the whole message (nothing lands), honest ones land bitwise.
    # One lane keeps it one message (striped, each lane's messages are checked the
    # same way: tests/test_transport_lanes.py).
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)
    with make_backend("ucx", config=AgentConfig(tcp_lanes=1)) as b:
        _many_runs_checked_whole(b)


def _many_runs_checked_whole(b):
    n, blk = 256, 4096
    src = np.random.default_rng(3).integers(0, 256, n * blk, dtype=np.uint8)
    back = np.zeros(n * blk, np.uint8)
    with guarded_target(2 * n * blk) as (pipe, meta, rid):
        ls, lb = b.register(src.ctypes.data, src.nbytes), b.register(back.ctypes.data, back.nbytes)
        conn = b.connect(widen_region(meta, rid, GUARD))
        i = np.arange(n, dtype=np.int64)
        rows = np.stack([np.full(n, ls), i * blk, np.full(n, rid), GUARD + (2 * i + 1) * blk, np.full(n, blk)], 1)
        forged = rows.copy()
        forged[n // 2, 3] = GUARD - blk  # one run just below the pool
        with pytest.raises(InvalidDescriptor, match="refused"):
            b.wait(b.post(conn, "write", forged), T)
        assert not np.frombuffer(_ask(pipe, "bytes"), np.uint8).any(), "a refused message landed in part"
        assert _ask(pipe, "guards") == bytes([0xA5]) * (2 * GUARD)
        b.wait(b.post(conn, "write", rows), T)
        pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8).reshape(2 * n, blk)
        assert np.array_equal(pool[1::2].ravel(), src) and not pool[0::2].any()
        read = rows.copy()
        read[:, 0] = lb
        b.wait(b.post(conn, "read", read), T)
        assert np.array_equal(back, src)
        forged[:, 0] = lb
        with pytest.raises(InvalidDescriptor, match="refused"):
            b.wait(b.post(conn, "read", forged), T)
        assert _ask(pipe, "rejected") == 2
