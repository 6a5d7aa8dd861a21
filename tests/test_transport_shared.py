"""Shared-memory pools (kvxfer.shared_empty) on the same-host vm path, between real processes.

The peer's pool lies inside a sealed memfd; the initiator maps it at connect and
copies with memcpy. Bytes must land exactly as over process_vm_writev, bounds
stay the advertised region's (not the memfd's), a forged or mismatched memfd
advert falls back to process_vm_writev, and a peer killed mid-copy still ends in
PeerDisconnected (the ``vm-shared`` mode of tests/test_transport_ucx.py: scattered,
small and mixed runs, bounds, deregistration, a peer killed mid-batch).
"""
import contextlib
import gc
import struct

import numpy as np
import pytest
import torch

import kvxfer
from kvxfer._native import load
from kvxfer.errors import InvalidDescriptor, ProtocolError
from kvxfer.transport import make_backend

import transport_peer

POOL = 1 << 20
GUARD = 64 << 10
BLOCK = 4096


def shared_peer(pool_bytes=POOL, guard_bytes=GUARD):
    return transport_peer.spawned(pool_bytes, {}, guard_bytes=guard_bytes, shared=True)


_ask = transport_peer.ask


@contextlib.contextmanager
def vm_backend(config=None):
    b = make_backend("vm", config=config)
    try:
        yield b
    finally:
        b.close()


def test_shared_empty_is_zeroed_shared_memory_and_freed_with_the_tensor():
    c = load()
    t = kvxfer.shared_empty((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert not t.view(torch.uint8).any()
    addr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    offset, pieces = c.shared_lookup(addr, nbytes)
    assert offset == 0 and len(pieces) == 1
    fd, ino, size = pieces[0]
    assert fd >= 0 and ino > 0 and size >= nbytes and size % 4096 == 0
    assert c.shared_lookup(addr + 10, nbytes - 20) == (10, pieces)
    view = t[1:]  # a view keeps the memory
    del t
    gc.collect()
    assert c.shared_lookup(addr, nbytes)[1] == pieces
    view.fill_(1.5)
    del view
    gc.collect()
    assert c.shared_lookup(addr, nbytes)[1] == []  # unmapped with the last view
    assert c.shared_lookup(torch.zeros(16).data_ptr(), 16)[1] == []  # torch memory is not shared
    assert kvxfer.shared_empty(10).dtype == torch.uint8


def test_a_range_over_allocations_back_to_back_is_shared_only_without_gaps():
    c = load()
    ts = [kvxfer.shared_empty(4096) for _ in range(8)]
    addrs = sorted(t.data_ptr() for t in ts)
    runs = [a for a, b in zip(addrs, addrs[1:]) if b == a + 4096]
    if not runs:
        pytest.skip("no two allocations were placed back to back")
    a = runs[0]
    offset, pieces = c.shared_lookup(a + 100, 4096)  # straddles two allocations
    assert offset == 100 and len(pieces) == 2 and pieces[0] != pieces[1]
    gap = next((x for x in addrs if x - 4096 not in addrs and x != addrs[0]), None)
    if gap is not None:
        assert c.shared_lookup(gap - 100, 200)[1] == []  # starts in memory that is not shared


@pytest.mark.parametrize("shape, dtype, err", [((0, 4), None, ValueError), ((-1,), None, ValueError),
                                               ((2.0,), None, TypeError), ((4,), "float32", TypeError)])
def test_shared_empty_refuses_bad_arguments(shape, dtype, err):
    with pytest.raises(err):
        kvxfer.shared_empty(shape, dtype)


def test_a_batch_past_the_streaming_size_lands_bitwise_both_ways():
    # From 32 MiB per batch the copy uses non-temporal stores: runs at odd offsets and
    # lengths (unaligned heads and tails), scattered and split across the copy threads.
    pool = 40 << 20
    rng = np.random.default_rng(14)
    run, stride = 200_003, 200_704
    n = pool // stride
    src = rng.integers(0, 256, n * run, dtype=np.uint8)
    slots = rng.permutation(n)
    assert src.nbytes >= 32 << 20
    with shared_peer(pool, 0) as (_, pipe, meta, rid), vm_backend() as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        assert conn.shared_regions == 1
        rows = np.array([[ls, i * run, rid, s * stride + 5, run] for i, s in enumerate(slots)], np.int64)
        b.wait(b.post(conn, "write", rows), timeout=60)
        got = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        for i, s in enumerate(slots):
            assert np.array_equal(got[s * stride + 5 : s * stride + 5 + run], src[i * run : (i + 1) * run])
        dst = np.zeros_like(src)
        rows[:, 0] = b.register(dst.ctypes.data, dst.nbytes)
        b.wait(b.post(conn, "read", rows[::-1].copy()), timeout=60)
        assert np.array_equal(dst, src)


def test_bounds_are_the_region_not_the_whole_memfd():
    # The memfd holds guard bytes on both sides of the registered pool; the
    # mapping covers them, the descriptors may not.
    src = np.full(2 * BLOCK, 7, np.uint8)
    with shared_peer() as (_, pipe, meta, rid), vm_backend() as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        assert conn.shared_regions == 1
        for rows in ([[ls, 0, rid, 0, BLOCK], [ls, BLOCK, rid, POOL - 10, BLOCK]],  # runs past the end
                     [[ls, 0, rid, -BLOCK, BLOCK]]):                               # before the start
            with pytest.raises(InvalidDescriptor):
                b.post(conn, "write", rows)
        assert not np.frombuffer(_ask(pipe, "bytes"), np.uint8).any()  # nothing of a refused batch landed
        assert _ask(pipe, "guards") == b"\xa5" * (2 * GUARD)
        b.wait(b.post(conn, "write", [[ls, 0, rid, POOL - BLOCK, BLOCK]]), timeout=30)  # the last block is fine
        assert np.frombuffer(_ask(pipe, "bytes"), np.uint8)[-BLOCK:].tolist() == [7] * BLOCK
        assert _ask(pipe, "guards") == b"\xa5" * (2 * GUARD)


# ---- forged adverts: decode the metadata, change the memfd fields, re-checksum ----

def _fnv1a(data: bytes) -> int:
    h = 1469598103934665603
    for byte in data:
        h = ((h ^ byte) * 1099511628211) & (2**64 - 1)
    return h


def _forge(meta: bytes, **changes) -> bytes:
    """Metadata with the first region's shared-memory fields (offset; fd, ino, size of its
    first piece) changed."""
    body = bytearray(meta[:-8])
    pos = 4 + 2 + 8 + 4

    def skip_str(p):
        (n,) = struct.unpack_from("<I", body, p)
        return p + 4 + n

    pos = skip_str(skip_str(pos)) + 8 * 3      # hostname, boot id, pid ns, probe addr/length
    pos = skip_str(skip_str(pos))               # probe token, worker address
    (nregions,) = struct.unpack_from("<I", body, pos)
    assert nregions == 1
    pos = skip_str(pos + 4 + 8 * 3 + 4)         # id, addr, length, kind, rkey
    offset, npieces = struct.unpack_from("<QI", body, pos)
    assert npieces == 1, "the peer's pool should be advertised as one shared piece"
    fd, ino, size = struct.unpack_from("<iQQ", body, pos + 12)
    fields = dict(offset=offset, fd=fd, ino=ino, size=size)
    fields.update(changes)
    struct.pack_into("<QIiQQ", body, pos, fields["offset"], 1, fields["fd"], fields["ino"], fields["size"])
    return bytes(body) + struct.pack("<Q", _fnv1a(bytes(body)))


@pytest.mark.parametrize("change", ["ino", "size", "fd"])
def test_a_memfd_advert_that_does_not_check_out_falls_back_to_process_vm(change):
    src = np.random.default_rng(12).integers(0, 256, 8 * BLOCK, dtype=np.uint8)
    with shared_peer() as (proc, pipe, meta, rid), vm_backend() as b:
        assert b.connect(_forge(meta)).shared_regions == 1  # re-encoded unchanged: still maps
        if change == "ino":
            forged = _forge(meta, ino=1)
        elif change == "size":
            forged = _forge(meta, size=POOL + 2 * GUARD + 4096)
        else:  # an fd of the peer that is not a sealed memfd (its stdin, /dev/null in a spawned child)
            forged = _forge(meta, fd=0)
        conn = b.connect(forged)
        assert conn.transport == "vm" and conn.shared_regions == 0
        ls = b.register(src.ctypes.data, src.nbytes)
        rows = [[ls, i * BLOCK, rid, (7 - i) * 2 * BLOCK, BLOCK] for i in range(8)]
        b.wait(b.post(conn, "write", rows), timeout=30)  # over process_vm_writev, bitwise all the same
        pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        for i in range(8):
            assert np.array_equal(pool[(7 - i) * 2 * BLOCK : (7 - i) * 2 * BLOCK + BLOCK], src[i * BLOCK : (i + 1) * BLOCK])


def test_an_advert_whose_region_exceeds_its_memfd_is_a_protocol_error():
    with shared_peer() as (_, pipe, meta, rid), vm_backend() as b:
        with pytest.raises(ProtocolError):
            b.connect(_forge(meta, offset=POOL + 2 * GUARD - 100))
