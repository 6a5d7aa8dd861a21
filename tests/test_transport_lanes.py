"""Striping over several TCP connections (AgentConfig.tcp_lanes, csrc/stripe.h) between
real processes over UCX TCP: bytes land bitwise, both directions; a peer killed
mid-transfer fails the request with PeerDisconnected within its timeout; every lane's
endpoint is closed on disconnect; transports that are not TCP keep one endpoint; by
default (tcp_lanes = 1) a TCP connection has one endpoint and one socket."""
import os

import numpy as np
import pytest

from kvxfer import AgentConfig
from kvxfer.errors import InvalidDescriptor, PeerDisconnected

import transport_peer
from test_transport_ucx import _ask, initiator, peer

LANES = 4
KIB = 1024


def _established(pid: int) -> int:
    psutil = pytest.importorskip("psutil")
    return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.status == "ESTABLISHED")


@pytest.mark.parametrize("run", [4 * KIB + 3, 64 * KIB, 1 << 20])
def test_striped_write_and_read_are_bitwise(run):
    # Scattered, reversed remote slots and odd run lengths: the lane boundaries cut
    # runs mid-way (4 KiB + 3), fall between runs (64 KiB) or inside a message (1 MiB).
    n = (6 << 20) // run
    pool = 2 * n * run + 4096
    rng = np.random.default_rng(run)
    src = rng.integers(0, 256, n * run, dtype=np.uint8)
    slots = rng.permutation(2 * n)[:n]
    with peer("tcp", pool) as (proc, pipe, meta, rid), initiator("tcp", AgentConfig(tcp_lanes=LANES)) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        before = _established(os.getpid())
        conn = b.connect(meta)
        assert conn.transport == "ucx:tcp+am-rma" and conn.lanes == LANES and b.num_endpoints == LANES
        rows = np.array([[ls, i * run, rid, s * run + 7, run] for i, s in enumerate(slots)], np.int64)
        b.wait(b.post(conn, "write", rows), timeout=60)
        got = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        expect = np.zeros(pool, np.uint8)
        for i, s in enumerate(slots):
            expect[s * run + 7 : (s + 1) * run + 7] = src[i * run : (i + 1) * run]
        assert np.array_equal(got, expect)
        assert _established(os.getpid()) - before >= LANES  # one TCP socket per lane

        dst = np.zeros_like(src)
        rows[:, 0] = b.register(dst.ctypes.data, dst.nbytes)
        b.wait(b.post(conn, "read", rows[::-1].copy()), timeout=60)
        assert np.array_equal(dst, src)
        b.disconnect(conn)
        assert b.num_endpoints == 0


def test_the_target_checks_every_lane_and_a_refusal_fails_the_request():
    # Both lanes' ranges name a region the target deregistered since: it refuses every
    # message on either socket, nothing is written, the request is InvalidDescriptor.
    src = np.full(2 << 20, 5, np.uint8)
    with peer("tcp", 4 << 20) as (_, pipe, meta, rid), initiator("tcp", AgentConfig(tcp_lanes=2)) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        stale = b.connect(meta)
        _ask(pipe, "deregister")
        with pytest.raises(InvalidDescriptor, match="refused"):
            b.wait(b.post(stale, "write", [[ls, 0, rid, 0, src.nbytes]]), timeout=30)
        assert not np.frombuffer(_ask(pipe, "bytes"), np.uint8).any()


def test_peer_killed_mid_striped_transfer_is_peer_disconnected_within_the_timeout():
    size = 32 << 20
    src = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    with initiator("tcp", AgentConfig(tcp_lanes=LANES)) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        with peer("tcp", size) as (proc, pipe, meta, rid):
            conn = b.connect(meta)
            assert conn.lanes == LANES
            rows = [[ls, 0, rid, 0, size]]
            b.wait(b.post(conn, "write", rows), timeout=60)  # every lane connected and used
            failing_s = transport_peer.write_until_killed(b, conn, rows, proc, after_s=0.2)
            assert failing_s < 20 + 5  # failed by the write's timeout, not hung past it
            with pytest.raises(PeerDisconnected):
                b.post(conn, "write", rows)
            b.disconnect(conn)
            assert b.num_endpoints == 0
        # the survivor stripes to a new peer
        with peer("tcp", 4 << 20) as (_, pipe, meta, rid):
            conn = b.connect(meta)
            assert conn.lanes == LANES and b.num_endpoints == LANES
            b.wait(b.post(conn, "write", [[ls, 0, rid, 0, 4 << 20]]), timeout=30)
            assert np.array_equal(np.frombuffer(_ask(pipe, "bytes"), np.uint8), src[: 4 << 20])


def test_by_default_a_tcp_connection_has_one_lane_and_one_socket():
    src = np.arange(2 << 20, dtype=np.uint8)  # large enough to be striped if lanes were > 1
    with peer("tcp", 2 << 20) as (_, pipe, meta, rid), initiator("tcp") as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        before = _established(os.getpid())
        conn = b.connect(meta)
        assert conn.transport == "ucx:tcp+am-rma" and conn.lanes == 1 and b.num_endpoints == 1
        b.wait(b.post(conn, "write", [[ls, 0, rid, 0, src.nbytes]]), timeout=30)
        assert np.array_equal(np.frombuffer(_ask(pipe, "bytes"), np.uint8), src)
        assert _established(os.getpid()) - before == 1


@pytest.mark.parametrize("mode", ["vm", "ucx"])
def test_transports_that_are_not_tcp_keep_one_endpoint(mode):
    src = np.arange(1 << 20, dtype=np.uint8)
    with peer(mode, 1 << 20) as (_, pipe, meta, rid), initiator(mode, AgentConfig(tcp_lanes=LANES)) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        assert conn.lanes == 1 and b.num_endpoints == 1
        b.wait(b.post(conn, "write", [[ls, 0, rid, 0, src.nbytes]]), timeout=30)
        assert np.array_equal(np.frombuffer(_ask(pipe, "bytes"), np.uint8), src)
