"""The store's object checksum (XXH64 over runs, native): reference value, split invariance."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.store.objects import checksum


def test_reference_value_and_split_invariance():
    assert checksum([], []) == 0xEF46DB3751D8E999  # XXH64 of no bytes, seed 0
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, 100_003, dtype=np.uint8)
    a = buf.ctypes.data
    whole = checksum([a], [buf.size])
    for cuts in ([1], [31, 32, 33], [7, 8, 4000, 4001, 99_999], list(range(0, 100_003, 4093))[1:]):
        edges = [0, *cuts, buf.size]
        assert checksum([a + s for s in edges[:-1]], [e - s for s, e in zip(edges[:-1], edges[1:])]) == whole
    assert checksum([a], [buf.size - 1]) != whole
    buf[50_000] ^= 0x01
    assert checksum([a], [buf.size]) != whole


def test_bad_runs_are_refused():
    with pytest.raises(ValueError):
        checksum([0], [8])
    with pytest.raises(ValueError):
        checksum([1, 2], [1])
