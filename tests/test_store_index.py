"""kvxfer.store.index.SlotIndex: two-phase put, LRU eviction above the watermark, pins."""
from __future__ import annotations

import pytest

from kvxfer.store import index as ix

LEASE = 30.0


def slots(n, **kw):
    """An index of ``n`` chunks of 64 bytes: every object of these tests (<= 64 B) takes one."""
    return ix.SlotIndex(n * 64, 64, **kw)


def put(idx, key, owner=1, now=0.0, nbytes=10, fmt="f"):
    code, obj = idx.reserve(key, nbytes, fmt, owner, now, LEASE)
    assert code == ix.RESERVED
    assert idx.commit(key, obj.token, 123, owner)
    return obj


def test_pending_is_invisible_until_commit():
    idx = slots(4)
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
        idx.reserve(b"b", 65, "f", 1, 0.0, LEASE)


def test_lapsed_reservation_is_taken_back_and_its_commit_refused():
    idx = slots(1)
    _, old = idx.reserve(b"a", 10, "f", 1, 0.0, LEASE)
    assert idx.reserve(b"b", 10, "f", 2, 1.0, LEASE)[0] == ix.FULL
    assert idx.expire(LEASE + 1) == 1 and idx.slots_used == 0
    _, new = idx.reserve(b"a", 10, "f", 2, LEASE + 1, LEASE)
    assert not idx.commit(b"a", old.token, 0, 1)  # the late writer cannot publish
    assert idx.commit(b"a", new.token, 0, 2)


def test_lru_eviction_above_watermark_counts_and_spares_recent():
    idx = slots(10, high_watermark=0.8)  # at most 8 slots in use
    for i in range(8):
        put(idx, bytes([i]))
    assert idx.evictions == 0 and len(idx) == 8
    idx.reserve(bytes([0]), 10, "f", 1, 0.0, LEASE)  # present: a no-op that refreshes recency
    put(idx, b"new")
    assert idx.evictions == 1 and not idx.contains(bytes([1])) and idx.contains(bytes([0]))
    assert idx.slots_used <= 8
    assert idx.stats()["evictions"] == 1


def test_pinned_objects_are_never_evicted_or_freed():
    idx = slots(2, high_watermark=1.0)
    a = put(idx, b"a")
    _, pin = idx.get(b"a", "f", 5, 0.0, LEASE)
    put(idx, b"b")
    code, c = idx.reserve(b"c", 10, "f", 1, 0.0, LEASE)  # evicts b, the only unpinned one
    assert code == ix.RESERVED and idx.contains(b"a") and not idx.contains(b"b")
    assert c.offset != a.offset
    assert idx.reserve(b"d", 10, "f", 1, 0.0, LEASE)[0] == ix.FULL  # a pinned, c pending
    # a reader that found a's bytes bad: a leaves the index, but its slot stays until unpinned
    _, pin2 = idx.get(b"a", "f", 6, 0.0, LEASE)
    assert idx.release(pin, 5, bad=True) and not idx.contains(b"a") and idx.bad == 1
    assert idx.reserve(b"d", 10, "f", 1, 0.0, LEASE)[0] == ix.FULL
    assert not idx.release(pin2, 5)  # not that client's pin
    assert idx.release(pin2, 6)
    code, d = idx.reserve(b"d", 10, "f", 1, 0.0, LEASE)
    assert code == ix.RESERVED and d.offset == a.offset


def test_per_client_limits_and_departure():
    idx = slots(8, max_pending=2, max_pins=1)
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


def part(idx, key, lo, hi, owner, now=0.0, of=4, nbytes=10, fmt="f"):
    return idx.reserve_part(key, nbytes, fmt, lo, hi, of, owner, now, LEASE)


def test_parts_commit_the_object_once_they_cover_every_head():
    idx = slots(4)
    code, obj, p0 = part(idx, b"a", 0, 2, owner=1)
    assert code == ix.RESERVED and idx.slots_used == 1
    code, joined, p1 = part(idx, b"a", 2, 4, owner=2)
    assert code == ix.RESERVED and joined is obj and p1.token != p0.token and idx.slots_used == 1
    assert not idx.commit(b"a", p1.token, 5, 1)  # not client 1's part
    assert idx.commit(b"a", p1.token, 5, 2) and not idx.contains(b"a")  # half: still pending
    assert not idx.commit(b"a", p1.token, 5, 2)  # committed already
    assert idx.get(b"a", "f", 3, 0.0, LEASE) == (None, 0)
    assert idx.commit(b"a", p0.token, 7, 1) and idx.contains(b"a")
    got, pin = idx.get(b"a", "f", 3, 0.0, LEASE)
    assert got.crc == [[0, 2, 7], [2, 4, 5]] and pin > 0 and idx.stats()["pending"] == 0
    for lo, hi, owner in ((0, 2, 1), (2, 4, 2), (1, 3, 9)):  # present: a no-op for every rank
        assert part(idx, b"a", lo, hi, owner)[0] == ix.PRESENT
    assert idx.reserve(b"a", 10, "f", 5, 0.0, LEASE)[0] == ix.PRESENT


def test_overlapping_parts_conflict_equal_ones_are_busy():
    idx = slots(4)
    part(idx, b"a", 0, 2, owner=1)
    assert part(idx, b"a", 0, 2, owner=2)[0] == ix.BUSY  # the same heads: being written
    assert part(idx, b"a", 1, 2, owner=2)[0] == ix.CONFLICT  # inside them
    assert part(idx, b"a", 1, 3, owner=2)[0] == ix.CONFLICT  # across them
    assert part(idx, b"a", 2, 4, owner=2, nbytes=11)[0] == ix.CONFLICT  # another object size
    assert part(idx, b"a", 2, 4, owner=2, of=8)[0] == ix.CONFLICT  # another head count
    assert part(idx, b"a", 2, 4, owner=2, fmt="g")[0] == ix.CONFLICT  # another model
    assert idx.reserve(b"a", 10, "f", 2, 0.0, LEASE)[0] == ix.BUSY  # a whole put waits for the parts
    idx.reserve(b"w", 10, "f", 1, 0.0, LEASE)
    assert part(idx, b"w", 0, 2, owner=2)[0] == ix.BUSY  # ... and parts for a whole put
    # another split composes: heads are heads
    assert [part(idx, b"a", lo, lo + 1, owner=3)[0] for lo in (2, 3)] == [ix.RESERVED, ix.RESERVED]
    with pytest.raises(ValueError):
        part(idx, b"b", 2, 2, owner=1)
    with pytest.raises(ValueError):
        part(idx, b"b", 0, 5, owner=1)
    assert idx.slots_used == 2


def test_an_incomplete_object_lapses_whole_and_frees_its_slot():
    idx = slots(2)
    _, _, p0 = part(idx, b"a", 0, 2, owner=1, now=0.0)
    assert idx.commit(b"a", p0.token, 1, 1)
    _, _, p1 = part(idx, b"a", 2, 4, owner=2, now=10.0)  # joining renews the lease
    assert idx.expire(LEASE + 1) == 0
    assert idx.expire(LEASE + 11) == 1 and idx.slots_used == 0 and idx.stats()["pending"] == 0
    assert not idx.commit(b"a", p1.token, 1, 2) and not idx.contains(b"a")  # the late rank cannot publish
    # a reservation found lapsed at reserve time starts a fresh object: the old parts are gone
    part(idx, b"b", 0, 2, owner=1, now=0.0)
    code, obj, _ = part(idx, b"b", 2, 4, owner=2, now=LEASE + 1)
    assert code == ix.RESERVED and [(p.lo, p.hi) for p in obj.parts] == [(2, 4)]


def test_abort_or_departure_of_an_unfinished_part_drops_the_object():
    idx = slots(4)
    _, _, p0 = part(idx, b"a", 0, 2, owner=1)
    _, _, p1 = part(idx, b"a", 2, 4, owner=2)
    assert not idx.abort(b"a", p1.token, 1)  # not client 1's part
    assert idx.abort(b"a", p1.token, 2) and idx.slots_used == 0
    assert not idx.commit(b"a", p0.token, 1, 1)
    # a client that committed its part may leave: the object can still complete
    _, _, p0 = part(idx, b"b", 0, 2, owner=1)
    assert idx.commit(b"b", p0.token, 1, 1)
    idx.forget_owner(1)
    assert idx.stats()["pending"] == 1
    _, _, p1 = part(idx, b"b", 2, 4, owner=2)
    assert idx.commit(b"b", p1.token, 2, 2) and idx.contains(b"b")
    # ... but one that leaves with its part unwritten takes the object with it
    _, _, p0 = part(idx, b"c", 0, 2, owner=3)
    assert idx.commit(b"c", p0.token, 1, 3)
    part(idx, b"c", 2, 4, owner=4)
    idx.forget_owner(4)
    assert idx.stats()["pending"] == 0 and idx.slots_used == 1  # b's slot only


def test_parts_count_against_their_clients_until_the_object_ends():
    """A committed part of an object that never completes still holds a slot: it counts."""
    idx = slots(8, max_pending=2)
    for key in (b"a", b"b"):
        _, _, p = part(idx, key, 0, 2, owner=1)
        assert idx.commit(key, p.token, 1, 1)
    assert part(idx, b"c", 0, 2, owner=1)[0] == ix.LIMIT
    assert part(idx, b"a", 2, 4, owner=2)[0] == ix.RESERVED  # others unaffected
    _, _, p = part(idx, b"b", 2, 4, owner=2)
    assert idx.commit(b"b", p.token, 1, 2) and idx.contains(b"b")  # b done: one of client 1's back
    assert part(idx, b"c", 0, 2, owner=1)[0] == ix.RESERVED
    assert idx.stats()["pending"] == 2  # a (half), c


def test_many_parts_cost_a_reserve_or_commit_little():
    """A forged object of MAX_HEADS one-head parts: each further reserve (a request may
    name the key MAX_KEYS times) and commit looks at its neighbours only."""
    import time

    from kvxfer.store.protocol import MAX_HEADS, MAX_KEYS

    idx = slots(2, max_pending=MAX_HEADS)
    tokens = [part(idx, b"a", h, h + 1, owner=1, of=MAX_HEADS)[2].token for h in range(0, MAX_HEADS, 2)]
    start = time.perf_counter()
    codes = {part(idx, b"a", 1, 3, owner=2, of=MAX_HEADS)[0] for _ in range(MAX_KEYS)}
    assert codes == {ix.CONFLICT} and time.perf_counter() - start < 1.0
    assert all(idx.commit(b"a", t, 1, 1) for t in tokens) and not idx.contains(b"a")
    for h in range(1, MAX_HEADS, 2):
        _, _, p = part(idx, b"a", h, h + 1, owner=2, of=MAX_HEADS)
        assert idx.commit(b"a", p.token, 2, 2)
    assert idx.contains(b"a") and len(idx.peek(b"a").crc) == MAX_HEADS


def test_a_spare_slot_becomes_the_object_committed_into_it():
    """A spare is a slot reserved under no key: committing it names the key, the size,
    format and checksum; it is then an ordinary object (readable, LRU, evictable)."""
    idx = slots(4)
    code, spare = idx.reserve_spare(1, 0.0, LEASE)
    assert code == ix.RESERVED and idx.slots_used == 1 and idx.stats()["spares"] == 1
    assert not idx.contains(b"a") and len(idx) == 0  # nothing readable yet
    assert idx.commit_spare(b"a", spare.token, 60, "f", 77, 1, 1.0) == ix.COMMITTED
    got, pin = idx.get(b"a", "f", 2, 1.0, LEASE)
    assert got.offset == spare.offset and got.nbytes == 60 and got.crc == 77 and pin > 0
    assert idx.stats()["spares"] == 0 and idx.stats()["pending"] == 0 and idx.bytes_used == 60
    assert idx.get(b"a", "other-format", 2, 1.0, LEASE) == (None, 0)
    # used up: the token names no spare any more
    assert idx.commit_spare(b"b", spare.token, 60, "f", 77, 1, 1.0) == ix.NO_SPARE
    with pytest.raises(ValueError):
        idx.commit_spare(b"b", spare.token, 65, "f", 77, 1, 1.0)


def test_a_spare_stays_its_clients_when_the_key_is_present_or_busy():
    idx = slots(8)
    put(idx, b"old")
    _, pending = idx.reserve(b"busy", 10, "f", 2, 0.0, LEASE)
    _, spare = idx.reserve_spare(1, 0.0, LEASE)
    before = list(idx._objects)
    assert idx.commit_spare(b"new", spare.token, 10, "f", 1, 1, 0.0) == ix.COMMITTED
    _, spare = idx.reserve_spare(1, 0.0, LEASE)
    assert idx.commit_spare(b"old", spare.token, 10, "f", 1, 1, 0.0) == ix.PRESENT  # refreshed, spare kept
    assert list(idx._objects)[-1] == b"old" and before[0] == b"old"
    assert idx.commit_spare(b"busy", spare.token, 10, "f", 1, 1, 0.0) == ix.BUSY  # client 2 writes it
    assert idx.commit_spare(b"old", 0, 10, "f", 1, 1, 0.0) == ix.PRESENT  # token 0: a presence check
    assert idx.commit_spare(b"gone", 0, 10, "f", 1, 1, 0.0) == ix.NO_SPARE
    assert idx.commit_spare(b"k", spare.token, 10, "f", 1, 2, 0.0) == ix.NO_SPARE  # not client 2's spare
    assert idx.commit_spare(b"k", spare.token, 10, "f", 1, 1, 0.0) == ix.COMMITTED  # still client 1's
    assert idx.commit(b"busy", pending.token, 5, 2)  # the other client's reservation was untouched
    # a reservation that lapsed gives way to a spare's commit
    _, late = idx.reserve(b"late", 10, "f", 2, 0.0, LEASE)
    _, spare = idx.reserve_spare(1, LEASE + 1, LEASE)
    assert idx.commit_spare(b"late", spare.token, 10, "f", 9, 1, LEASE + 1) == ix.COMMITTED
    assert not idx.commit(b"late", late.token, 5, 2) and idx.peek(b"late").crc == 9


def test_spares_lapse_leave_with_their_client_and_count_as_reservations():
    idx = slots(8, max_pending=2)
    _, a = idx.reserve_spare(1, 0.0, LEASE)
    idx.reserve(b"x", 10, "f", 1, 0.0, LEASE)
    assert idx.reserve_spare(1, 0.0, LEASE) == (ix.LIMIT, None)  # one spare + one reservation
    assert idx.reserve_spare(2, 0.0, LEASE)[0] == ix.RESERVED
    # a lapsed spare is no spare: committing into it changes nothing
    assert idx.commit_spare(b"k", a.token, 10, "f", 1, 1, LEASE + 1) == ix.NO_SPARE
    assert not idx.contains(b"k") and idx.stats()["spares"] == 1 and idx.slots_used == 2
    assert idx.expire(LEASE + 1) == 2  # client 1's reservation and client 2's spare
    assert idx.slots_used == 0 and idx.stats()["spares"] == 0
    assert idx.reserve_spare(1, LEASE + 1, LEASE)[0] == idx.reserve_spare(1, LEASE + 1, LEASE)[0] == ix.RESERVED
    idx.forget_owner(1)
    assert idx.slots_used == 0 and idx.stats()["spares"] == 0


def test_spares_evict_above_the_watermark_and_stop_when_full():
    idx = slots(4, high_watermark=0.5)
    put(idx, b"a"), put(idx, b"b")
    assert idx.reserve_spare(1, 0.0, LEASE)[0] == ix.RESERVED
    assert not idx.contains(b"a") and idx.contains(b"b") and idx.evictions == 1
    idx.get(b"b", "f", 2, 0.0, LEASE)  # pinned: never evicted
    assert idx.reserve_spare(1, 0.0, LEASE)[0] == idx.reserve_spare(1, 0.0, LEASE)[0] == ix.RESERVED
    assert idx.reserve_spare(1, 0.0, LEASE) == (ix.FULL, None) and idx.contains(b"b")


def test_a_spare_asked_for_ahead_of_need_takes_only_a_free_slot():
    idx = slots(4, high_watermark=0.5)
    put(idx, b"a"), put(idx, b"b")
    assert idx.reserve_spare(1, 0.0, LEASE, evict=False)[0] == ix.RESERVED  # past the watermark: no eviction
    assert idx.reserve_spare(1, 0.0, LEASE, evict=False)[0] == ix.RESERVED
    assert idx.contains(b"a") and idx.contains(b"b") and idx.evictions == 0 and idx.slots_used == 4
    assert idx.reserve_spare(1, 0.0, LEASE, evict=False) == (ix.FULL, None) and idx.evictions == 0
    assert idx.reserve(b"c", 10, "f", 2, 0.0, LEASE)[0] == ix.RESERVED  # a reservation evicts back to it
    assert idx.evictions == 2 and not idx.contains(b"a") and not idx.contains(b"b")
