"""The store's object checksum (XXH3-64 over runs, native): known answers, the reference
implementation (the ``xxhash`` package) at every length class, split invariance."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.store.objects import checksum

xxhash = pytest.importorskip("xxhash")  # in the dev extra: CI has it


def _buf(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_known_answers():
    assert checksum([], []) == 0x2D06800538D394C2  # XXH3-64 of no bytes, seed 0
    buf = np.frombuffer(bytes(range(256)) * 4, dtype=np.uint8)
    assert checksum([buf.ctypes.data], [buf.size]) == 0xA870F92984398D22


def test_every_length_class_matches_the_reference():
    """0, 1-3, 4-8, 9-16, 17-128, 129-240 (short paths), then stripes, blocks of 1 KiB and
    the overlapping last stripe, around every boundary."""
    buf = _buf(300_000)
    a = buf.ctypes.data
    lengths = [*range(0, 2200), 4095, 4096, 4097, 65535, 65536, 65537, 100_003, 299_999]
    wrong = [n for n in lengths if checksum([a], [n]) != xxhash.xxh3_64_intdigest(buf[:n].tobytes())]
    assert wrong == []


def test_split_invariance():
    buf = _buf(100_003, seed=1)
    a = buf.ctypes.data
    whole = checksum([a], [buf.size])
    assert whole == xxhash.xxh3_64_intdigest(buf.tobytes())
    for cuts in ([1], [31, 32, 33], [63, 64, 65, 1023, 1024, 1025], [7, 8, 4000, 4001, 99_999],
                 list(range(0, 100_003, 4093))[1:], list(range(0, 100_003, 37))[1:]):
        edges = [0, *cuts, buf.size]
        assert checksum([a + s for s in edges[:-1]], [e - s for s, e in zip(edges[:-1], edges[1:])]) == whole, cuts
    small = _buf(200, seed=2)  # a short input gathered from runs, empty runs among them
    b = small.ctypes.data
    assert checksum([b, b + 10, b + 10, b + 150], [10, 0, 140, 50]) == xxhash.xxh3_64_intdigest(small.tobytes())
    assert checksum([a], [buf.size - 1]) != whole
    buf[50_000] ^= 0x01
    assert checksum([a], [buf.size]) != whole


def test_bad_runs_are_refused():
    with pytest.raises(ValueError):
        checksum([0], [8])
    with pytest.raises(ValueError):
        checksum([1, 2], [1])


@pytest.mark.parametrize("hash_", [True, False])
@pytest.mark.parametrize("into_hashed", [False, True])
def test_copying_while_hashing_copies_every_byte_and_hashes_the_same(into_hashed, hash_):
    """copy_checksum_objects (the same-host put and get): runs of every length class (0, short,
    around the 64 KiB copy chunk, over a MiB), placed on the other side in another order;
    every byte arrives, and the checksum is XXH3-64 of the hashed side's bytes (hash=False,
    a client without checksums: the same copies, each checksum 0)."""
    from kvxfer._native import load

    native = load()
    rng = np.random.default_rng(7)
    cases = [[5], [0, 3, 0], [240], [241], [65535, 1], [65536], [65537, 64], [1 << 20, 300_001, 17],
             list(rng.integers(0, 300, 40)), list(rng.integers(0, 200_000, 9))]
    for lens in cases:
        lens = np.asarray(lens, np.int64)
        total = int(lens.sum())
        data = _buf(max(total, 1), seed=len(lens))
        empty = np.zeros_like(data)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        order = rng.permutation(len(lens))  # the other side holds the runs in another order
        other_starts = np.zeros(len(lens), np.int64)
        at = 0
        for i in order:
            other_starts[i], at = at, at + lens[i]
        expected = xxhash.xxh3_64_intdigest(data[:total].tobytes()) if hash_ else 0
        if into_hashed:  # the bytes arrive in the hashed runs from the other side
            src = np.zeros_like(data)
            for i in range(len(lens)):
                src[other_starts[i]:other_starts[i] + lens[i]] = data[starts[i]:starts[i] + lens[i]]
            got, = native.copy_checksum_objects(empty.ctypes.data + starts, src.ctypes.data + other_starts, lens,
                                                [len(lens)], True, hash=hash_)
            assert np.array_equal(empty[:total], data[:total]), list(lens)
        else:
            got, = native.copy_checksum_objects(data.ctypes.data + starts, empty.ctypes.data + other_starts, lens,
                                                [len(lens)], False, hash=hash_)
            for i in range(len(lens)):
                assert np.array_equal(empty[other_starts[i]:other_starts[i] + lens[i]],
                                      data[starts[i]:starts[i] + lens[i]]), list(lens)
        assert got == expected, list(lens)
    # two objects in one call: each its own checksum
    data = _buf(1000, seed=3)
    out = np.zeros_like(data)
    sums = native.copy_checksum_objects(data.ctypes.data + np.array([0, 300, 700]), out.ctypes.data + np.array([0, 300, 700]),
                                        np.array([300, 400, 300]), [1, 2], False, hash=hash_)
    assert sums == ([xxhash.xxh3_64_intdigest(data[:300].tobytes()), xxhash.xxh3_64_intdigest(data[300:].tobytes())]
                    if hash_ else [0, 0])
    assert np.array_equal(out, data)
    with pytest.raises(ValueError):  # a null run, and counts that do not add up
        native.copy_checksum_objects(np.array([0]), np.array([8]), np.array([8]), [1], False, hash=hash_)
    with pytest.raises(ValueError):
        native.copy_checksum_objects(np.array([8]), np.array([8]), np.array([8]), [2], False, hash=hash_)


@pytest.mark.parametrize("hash_", [True, False])
@pytest.mark.parametrize("into_hashed", [False, True])
@pytest.mark.parametrize("dst_shift", [0, 8, 32, 100])
def test_copying_long_runs_at_every_destination_alignment(into_hashed, dst_shift, hash_):
    """Whole 1 KiB hash blocks are copied and hashed in one pass (each vector loaded once,
    streamed to a destination aligned for it, stored plainly elsewhere); runs that begin
    mid-block, mid-stripe or shorter than a block mix that pass with the gathering one.
    Every byte arrives and the checksum is XXH3-64 of the hashed side's bytes (hash=False:
    the same loop copies alone, each checksum 0)."""
    from kvxfer._native import load

    native = load()
    for lens in ([32 << 10] * 6, [100, 5000, 70_000, 1024, 64, 4096 * 3 + 7], [1023, 1025, 2048 + 64, 33 << 10]):
        lens = np.asarray(lens, np.int64)
        total = int(lens.sum())
        data = _buf(total + 4096, seed=int(lens[0]))
        base = (-data.ctypes.data) % 64  # hashed side: runs back to back from a 64-byte boundary
        starts = base + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        expected = xxhash.xxh3_64_intdigest(data[base:base + total].tobytes()) if hash_ else 0
        # the other side: each run at its own place, shifted by dst_shift from a 64-byte boundary
        other = np.zeros(total + 64 * len(lens) + 4096, np.uint8)
        at0 = (-other.ctypes.data) % 64 + dst_shift
        other_starts = np.empty(len(lens), np.int64)
        at = at0
        for i in reversed(range(len(lens))):  # reversed: no two runs stay adjacent
            other_starts[i] = at
            at += -(-int(lens[i]) // 64) * 64 + 64
        if into_hashed:
            src, dst = other, np.zeros_like(data)
            for i, n in enumerate(lens):
                src[other_starts[i]:other_starts[i] + n] = data[starts[i]:starts[i] + n]
            got, = native.copy_checksum_objects(dst.ctypes.data + starts, src.ctypes.data + other_starts, lens,
                                                [len(lens)], True, hash=hash_)
            assert np.array_equal(dst[base:base + total], data[base:base + total]), list(lens)
        else:
            got, = native.copy_checksum_objects(data.ctypes.data + starts, other.ctypes.data + other_starts, lens,
                                                [len(lens)], False, hash=hash_)
            for i, n in enumerate(lens):
                assert np.array_equal(other[other_starts[i]:other_starts[i] + n], data[starts[i]:starts[i] + n])
        assert got == expected, (list(lens), dst_shift)


@pytest.mark.parametrize("hash_", [True, False])
@pytest.mark.parametrize("into_hashed", [False, True])
def test_objects_spread_over_the_copy_pool_give_each_its_own_checksum(into_hashed, hash_):
    """From split_bytes on, copy_checksum_objects hands whole objects to the same-host copy
    pool's threads in turn: every object still arrives whole and gets the checksum of its
    own bytes, in its own place in the result, as on one thread (split_bytes=0); with
    hash=False the same objects arrive, each checksum 0."""
    from kvxfer._native import load

    native = load()
    counts = [3, 1, 5, 2, 4, 1, 3, 2, 6, 1, 2, 3]  # runs per object, of uneven lengths
    lens = np.random.default_rng(7).integers(1, 40_000, sum(counts)).astype(np.int64)
    total = int(lens.sum())
    data = _buf(total, seed=11)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    # on the other side the runs lie in reverse order, back to back
    other_starts = (total - starts - lens).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    expected = [xxhash.xxh3_64_intdigest(data[starts[first[i]]:starts[first[i]] + lens[first[i]:first[i + 1]].sum()]
                                         .tobytes()) if hash_ else 0 for i in range(len(counts))]
    results = {}
    for split in (0, 1, total):  # one thread; the pool from one byte on; the pool at exactly the total
        other = np.zeros(total, np.uint8)
        if into_hashed:  # the other side holds the bytes, each run at its place there
            for s, o, n in zip(starts, other_starts, lens):
                other[o:o + n] = data[s:s + n]
            dst = np.zeros(total, np.uint8)
            results[split] = native.copy_checksum_objects(dst.ctypes.data + starts, other.ctypes.data + other_starts,
                                                          lens, counts, True, split, hash=hash_)
            assert np.array_equal(dst, data), split
        else:
            results[split] = native.copy_checksum_objects(data.ctypes.data + starts, other.ctypes.data + other_starts,
                                                          lens, counts, False, split, hash=hash_)
            for s, o, n in zip(starts, other_starts, lens):
                assert np.array_equal(other[o:o + n], data[s:s + n]), split
        assert results[split] == expected, split
