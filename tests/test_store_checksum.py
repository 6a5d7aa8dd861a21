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
