"""kvxfer.store.index.SlotIndex: two-phase put, LRU eviction above the watermark, pins."""
from __future__ import annotations

import pytest

from kvxfer.store import index as ix

LEASE = 30.0


def put(idx, key, owner=1, now=0.0, nbytes=10, fmt="f"):
    code, obj = idx.reserve(key, nbytes, fmt, owner, now, LEASE)
    assert code == ix.RESERVED
    assert idx.commit(key, obj.token, 123, owner)
    return obj


def test_pending_is_invisible_until_commit():
    idx = ix.SlotIndex(4, 100)
    code, obj = idx.reserve(b"a", 10, "f", 1, 0.0, LEASE)
    assert code == ix.RESERVED and not idx.contains(b"a")
    assert idx.get(b"a", "f", 2, 0.0, LEASE) == (None, 0)
    assert idx.reserve(b"a", 10, "f", 2, 0.0, LEASE)[0] == ix.BUSY
    assert not idx.commit(b"a", obj.token + 1, 0, 1)  # wrong token
    assert not idx.commit(b"a", obj.token, 0, 2)  # not the reserving client
    assert idx.commit(b"a", obj.token, 7, 1)
    assert idx.contains(b"a") and idx.reserve(b"a", 10, "f", 2, 0.0, LEASE)[0] == ix.PRESENT
    got, pin = idx.get(b"a", "f", 2, 0.0, LEASE)
    assert got.crc == 7 and pin > 0
    assert idx.get(b"a", "other-model", 2, 0.0, LEASE) == (None, 0)
    with pytest.raises(ValueError):
        idx.reserve(b"b", 101, "f", 1, 0.0, LEASE)


def test_lapsed_reservation_is_taken_back_and_its_commit_refused():
    idx = ix.SlotIndex(1, 100)
    _, old = idx.reserve(b"a", 10, "f", 1, 0.0, LEASE)
    assert idx.reserve(b"b", 10, "f", 2, 1.0, LEASE)[0] == ix.FULL
    assert idx.expire(LEASE + 1) == 1 and idx.slots_used == 0
    _, new = idx.reserve(b"a", 10, "f", 2, LEASE + 1, LEASE)
    assert not idx.commit(b"a", old.token, 0, 1)  # the late writer cannot publish
    assert idx.commit(b"a", new.token, 0, 2)


def test_lru_eviction_above_watermark_counts_and_spares_recent():
    idx = ix.SlotIndex(10, 100, high_watermark=0.8)  # at most 8 slots in use
    for i in range(8):
        put(idx, bytes([i]))
    assert idx.evictions == 0 and len(idx) == 8
    idx.reserve(bytes([0]), 10, "f", 1, 0.0, LEASE)  # present: a no-op that refreshes recency
    put(idx, b"new")
    assert idx.evictions == 1 and not idx.contains(bytes([1])) and idx.contains(bytes([0]))
    assert idx.slots_used <= 8
    assert idx.stats()["evictions"] == 1


def test_pinned_objects_are_never_evicted_or_freed():
    idx = ix.SlotIndex(2, 100, high_watermark=1.0)
    a = put(idx, b"a")
    _, pin = idx.get(b"a", "f", 5, 0.0, LEASE)
    put(idx, b"b")
    code, c = idx.reserve(b"c", 10, "f", 1, 0.0, LEASE)  # evicts b, the only unpinned one
    assert code == ix.RESERVED and idx.contains(b"a") and not idx.contains(b"b")
    assert c.slot != a.slot
    assert idx.reserve(b"d", 10, "f", 1, 0.0, LEASE)[0] == ix.FULL  # a pinned, c pending
    # a reader that found a's bytes bad: a leaves the index, but its slot stays until unpinned
    _, pin2 = idx.get(b"a", "f", 6, 0.0, LEASE)
    assert idx.release(pin, 5, bad=True) and not idx.contains(b"a") and idx.bad == 1
    assert idx.reserve(b"d", 10, "f", 1, 0.0, LEASE)[0] == ix.FULL
    assert not idx.release(pin2, 5)  # not that client's pin
    assert idx.release(pin2, 6)
    code, d = idx.reserve(b"d", 10, "f", 1, 0.0, LEASE)
    assert code == ix.RESERVED and d.slot == a.slot


def test_per_client_limits_and_departure():
    idx = ix.SlotIndex(8, 100, max_pending=2, max_pins=1)
    idx.reserve(b"a", 10, "f", 1, 0.0, LEASE)
    idx.reserve(b"b", 10, "f", 1, 0.0, LEASE)
    assert idx.reserve(b"c", 10, "f", 1, 0.0, LEASE)[0] == ix.LIMIT
    assert idx.reserve(b"c", 10, "f", 2, 0.0, LEASE)[0] == ix.RESERVED  # others unaffected
    put(idx, b"x", owner=3)
    assert idx.get(b"x", "f", 4, 0.0, LEASE)[1] > 0
    assert idx.get(b"x", "f", 4, 0.0, LEASE) == (None, -1)
    idx.forget_owner(1)
    idx.forget_owner(4)
    st = idx.stats()
    assert st["pending"] == 1 and st["pins"] == 0 and idx.slots_used == 2
    assert idx.reserve(b"c", 10, "f", 1, 0.0, LEASE)[0] == ix.BUSY  # client 2 still writes c
