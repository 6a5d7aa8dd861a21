"""KVStore put/get, bitwise, across engine layouts and TP degrees, through a node in its own process."""
from __future__ import annotations

import signal

import pytest
import torch

import kvxfer
from kvxfer.store.objects import ObjectFormat
from store_cases import SECRET, block_bits, make_layout, start_node, stop_node


@pytest.fixture(scope="module")
def node():
    proc, addr = start_node(slot="128K")
    yield addr
    assert stop_node(proc, signal.SIGTERM) == 0  # SIGTERM: a clean exit


@pytest.fixture
def store(node):
    with kvxfer.KVStore(nodes=[node], secret=SECRET) as s:
        yield s


def put_then_get_reversed(writer, reader, keys, src, head_dim):
    """``writer`` puts every block of ``src`` under ``keys``; ``reader`` gets them into a
    fresh blocks-first NHD pool in reverse order, which must hold them bitwise."""
    n = src.num_blocks
    writer.put(keys, src, range(n)).wait(timeout=60)
    dst = make_layout("N 2 B H D", n, head_dim=head_dim)
    reader.get(keys, dst, range(n - 1, -1, -1)).wait(timeout=60)
    for s in range(n):
        assert torch.equal(block_bits(src, s), block_bits(dst, n - 1 - s))


def flip_stored_byte(conn, key, src, at: int, mask: int) -> None:
    """XOR ``mask`` into byte ``at`` of the object stored under ``key`` (put from ``src``'s
    layout), through ``conn``'s mapping of the node's slots (a client on this host)."""
    import ctypes

    from kvxfer.store.protocol import Req

    r = conn.request(Req.GET, {"keys": [key], "fmt": ObjectFormat(src).fmt}, 10)["r"]
    conn.send(Req.RELEASE, {"pins": [r[0][3]], "bad": []}, reply=False)
    ctypes.c_uint8.from_address(conn.slots_local + r[0][0] + at).value ^= mask


@pytest.mark.parametrize("head_dim", [8, 128])
def test_nhd_tp1_to_hnd_tp1_and_tp2(store, head_dim):
    """head_dim 8: every object through staging; 128: NHD pools move tiles straight
    between blocks and slots (zero-copy), HND and TP ranks through staging."""
    src = make_layout("2 N B H D", 12, seed=1, head_dim=head_dim)
    assert ObjectFormat(src).zero_copy == (head_dim == 128)
    keys = kvxfer.block_keys(range(7 * 4), 4, salt=b"roundtrip-1-%d" % head_dim)
    src_ids = [3, 0, 11, 5, 6, 2, 9]
    assert store.lookup(keys) == 0
    h = store.put(keys, src, src_ids)
    h.wait(timeout=60)
    assert h.nbytes == 7 * src.wire_nbytes(1)
    assert store.lookup(keys) == 7 and store.lookup(keys[:3]) == 3
    # another layout, other block ids
    dst = make_layout("N 2 H B D", 9, head_dim=head_dim)
    dst_ids = [8, 1, 2, 0, 4, 7, 3]
    store.get(keys, dst, dst_ids).wait(timeout=60)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(block_bits(src, s), block_bits(dst, d))
    # a TP group of two ranks: each loads its own heads of the same objects
    # a blocks-first NHD pool (zero-copy with head_dim 128)
    other = make_layout("N 2 B H D", 8, head_dim=head_dim)
    store.get(keys, other, [1, 2, 3, 4, 5, 6, 7]).wait(timeout=60)
    for s, d in zip(src_ids, [1, 2, 3, 4, 5, 6, 7]):
        assert torch.equal(block_bits(src, s), block_bits(other, d))
    for rank in range(2):
        part = make_layout("N 2 B H D", 8, tp_rank=rank, tp_size=2, head_dim=head_dim)
        ids = [7, 6, 5, 4, 3, 2, 1]
        store.get(keys, part, ids).wait(timeout=60)
        lo, hi = part.head_range
        for s, d in zip(src_ids, ids):
            assert torch.equal(block_bits(src, s)[:, :, :, lo:hi], block_bits(part, d))


def test_put_of_present_keys_is_a_no_op(store):
    a = make_layout("2 N B H D", 4, seed=2)
    b = make_layout("2 N B H D", 4, seed=3)
    keys = kvxfer.block_keys(range(8), 4, salt=b"roundtrip-2")
    store.put(keys, a, [0, 1]).wait(timeout=60)
    before = store.stats()["client"]["put_present"]
    store.put(keys, b, [0, 1]).wait(timeout=60)  # other bytes, same keys: objects are immutable
    assert store.stats()["client"]["put_present"] == before + 2
    out = make_layout("N 2 H B D", 4)
    store.get(keys, out, [2, 3]).wait(timeout=60)
    assert torch.equal(block_bits(a, 0), block_bits(out, 2)) and torch.equal(block_bits(a, 1), block_bits(out, 3))


def test_half_a_tp_group_and_bad_arguments_change_nothing(store):
    part = make_layout("N 2 B H D", 4, tp_rank=1, tp_size=2, seed=4)
    keys = kvxfer.block_keys(range(8), 4, salt=b"roundtrip-3")
    store.put(keys, part, [0, 1]).wait(timeout=60)  # one rank's part: the objects stay pending
    assert store.lookup(keys) == 0
    full = make_layout("2 N B H D", 4, seed=4)
    with pytest.raises(ValueError):
        store.put(keys, full, [0])  # one id for two keys
    with pytest.raises(ValueError):
        store.put(keys, full, [0, 4])  # out of range
    with pytest.raises(TypeError):
        store.lookup([b"ok", "not-bytes"])
    with pytest.raises(ValueError):
        store.lookup([b"x" * 65])
    with pytest.raises(TypeError):
        store.get(keys, "not a layout", [0, 1])
    assert store.lookup(keys) == 0


def test_get_of_missing_keys_fails_with_loaded_prefix(store):
    src = make_layout("2 N B H D", 4, seed=5)
    keys = kvxfer.block_keys(range(16), 4, salt=b"roundtrip-4")
    store.put(keys[:2] + keys[3:], src, [0, 1, 3]).wait(timeout=60)  # keys[2] is missing
    assert store.lookup(keys) == 2
    dst = make_layout("N 2 H B D", 4)
    h = store.get(keys, dst, [0, 1, 2, 3])
    with pytest.raises(kvxfer.StoreMiss) as err:
        h.wait(timeout=60)
    assert err.value.loaded == 2 and h.state == "failed"
    assert torch.equal(block_bits(src, 1), block_bits(dst, 1))


@pytest.mark.parametrize("head_dim", [8, 128])
def test_one_pass_copies_on_this_host_agree_with_the_remote_path(node, head_dim):
    """On this host a client copies between its blocks and the node's mapped slots and
    hashes in the same pass; a client on UCX only moves the bytes through the backend and
    hashes beside it. Objects either one puts, the other gets bitwise and verified (the
    checksums agree), and a corrupted object is a miss on either."""
    src = make_layout("2 N B H D", 6, seed=5, head_dim=head_dim)
    with kvxfer.KVStore(nodes=[node], secret=SECRET) as local, \
            kvxfer.KVStore(nodes=[node], secret=SECRET, backend="ucx") as remote:
        for writer, reader, tag in ((local, remote, b"l2r"), (remote, local, b"r2l")):
            keys = kvxfer.block_keys(range(6 * 4), 4, salt=b"one-pass-%s-%d" % (tag, head_dim))
            put_then_get_reversed(writer, reader, keys, src, head_dim)
            assert reader.stats()["client"]["checksum_failures"] == 0
        assert local._conns[node].slots_local != 0 and remote._conns[node].slots_local == 0
        # flip a byte of a stored object through the local mapping: each reader misses it
        # (its own checksum fails), never returns it
        for reader in (local, remote):
            keys = kvxfer.block_keys(range(4), 4, salt=b"one-pass-flip-%d-%d" % (head_dim, reader is local))
            local.put(keys, src, [2]).wait(timeout=60)
            flip_stored_byte(local._conns[node], keys[0], src, 7, 0x40)
            failures = reader.stats()["client"]["checksum_failures"]
            with pytest.raises(kvxfer.StoreMiss):
                reader.get(keys, make_layout("2 N B H D", 1, head_dim=head_dim), [0]).wait(timeout=60)
            assert reader.stats()["client"]["checksum_failures"] == failures + 1


@pytest.mark.parametrize("head_dim", [8, 128])
def test_remote_reads_in_pieces_of_several_objects_miss_only_the_corrupted_one(node, head_dim, monkeypatch):
    """A client on UCX only reads a get's objects in pieces of several objects each,
    checking each piece while the next ones move: with a byte flipped in the fifth of
    seven objects (in the second of three pieces), the get loads exactly the four before
    it, bitwise, and counts one checksum failure."""
    from kvxfer.store import copies as store_copies

    monkeypatch.setattr(store_copies, "READ_PIECES", 3)  # 7 objects: pieces of 3, 3 and 1
    src = make_layout("2 N B H D", 7, seed=11, head_dim=head_dim)
    keys = kvxfer.block_keys(range(7 * 4), 4, salt=b"pieces-%d" % head_dim)
    with kvxfer.KVStore(nodes=[node], secret=SECRET) as local, \
            kvxfer.KVStore(nodes=[node], secret=SECRET, backend="ucx") as remote:
        put_then_get_reversed(local, remote, keys, src, head_dim)
        flip_stored_byte(local._conns[node], keys[4], src, 5, 0x10)
        again = make_layout("N 2 B H D", 7, head_dim=head_dim)
        with pytest.raises(kvxfer.StoreMiss) as err:
            remote.get(keys, again, range(7)).wait(timeout=60)
        assert err.value.loaded == 4
        for s in range(4):
            assert torch.equal(block_bits(src, s), block_bits(again, s))
        assert remote.stats()["client"]["checksum_failures"] == 1
        assert remote._conns[node].slots_local == 0


@pytest.mark.parametrize("head_dim", [8, 128])
def test_objects_without_checksums_round_trip_on_either_path(node, head_dim):
    """``checksum=False``: on this host puts and gets copy through the node's slots mapped
    here in one native pass that copies alone; on UCX only they write and read through the
    backend's descriptors (staged whole or straight from the blocks). Either way gets read
    the objects back bitwise, and nothing is counted as a checksum failure."""
    src = make_layout("2 N B H D", 6, seed=9, head_dim=head_dim)
    for backend in ("auto", "ucx"):
        with kvxfer.KVStore(nodes=[node], secret=SECRET, checksum=False, backend=backend) as st:
            passes = []  # the one-pass copies, by direction (into: a get)
            one_pass = st._copier.copy_hashing
            st._copier.copy_hashing = lambda *a, **k: passes.append(k["into"]) or one_pass(*a, **k)
            keys = kvxfer.block_keys(range(6 * 4), 4, salt=b"no-crc-%s-%d" % (backend.encode(), head_dim))
            put_then_get_reversed(st, st, keys, src, head_dim)
            assert st.stats()["client"]["put_objects"] == 6
            assert st.stats()["client"]["checksum_failures"] == 0
            assert passes == ([False, True] if backend == "auto" else [])


def test_handles_report_what_they_stored_and_loaded_and_too_large_objects_fail(store):
    """A put's handle says how many objects it stored, found present and skipped; a get's,
    how many it loaded and missed. An object larger than the node's largest fails the put
    with a clear error, before anything moves."""
    from kvxfer.store.results import GetResult, PutResult

    src = make_layout("2 N B H D", 4, seed=12)
    keys = kvxfer.block_keys(range(16), 4, salt=b"results")
    h = store.put(keys[:2], src, [0, 1])
    h.wait(timeout=60)
    assert h.result == PutResult(stored=2, present=0, skipped=0, conflicts=0)
    h = store.put(keys, src, range(4))
    h.wait(timeout=60)
    assert h.result == PutResult(stored=2, present=2, skipped=0, conflicts=0)
    dst = make_layout("N 2 H B D", 4)
    g = store.get(keys, dst, range(4))
    g.wait(timeout=60)
    assert g.result == GetResult(loaded=4, from_disk=0, misses=0, checksum_failures=0)
    big = make_layout("2 N B H D", 1, head_dim=1024)  # 192 KiB objects; the node's largest is 128 KiB
    h = store.put(kvxfer.block_keys(range(4), 4, salt=b"too-big"), big, [0])
    with pytest.raises(kvxfer.LimitExceeded, match="exceed the largest"):
        h.wait(timeout=60)
    assert h.result.stored == 0 and store.lookup(kvxfer.block_keys(range(4), 4, salt=b"too-big")) == 0
