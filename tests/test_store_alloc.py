"""kvxfer.store.alloc.ChunkAllocator: size classes in pages, bounded rounding, recovery claims."""
from __future__ import annotations

import random

import pytest

from kvxfer.store.alloc import ALIGN_LARGE, ChunkAllocator, chunk_bytes
from kvxfer.store.index import SlotIndex, RESERVED, FULL

# the three object sizes of the store tests' models (tests/store_cases.py, tests/test_store_tiers.py):
# 3 layers x K/V x 4 tokens x 4 heads x D (8 or 128) x 2 B, and a larger model of 8 layers x 8 heads x 128
MIX = (1536, 24 << 10, 128 << 10)


def test_chunks_are_aligned_and_round_little():
    assert chunk_bytes(1536) == 1536 and chunk_bytes(1537) == 1600 and chunk_bytes(24 << 10) == 24 << 10
    assert chunk_bytes(64 << 10) == 64 << 10 and chunk_bytes((64 << 10) + 1) == (64 << 10) + ALIGN_LARGE
    for n in (1, 63, 1000, 5000, 70000, 2 << 20, (2 << 20) + 5):
        c = chunk_bytes(n)
        assert c >= n and (c - n) / c < (1 / 16 if n >= 64 << 10 else 64 / n)


def test_pages_take_a_class_and_come_back_free():
    a = ChunkAllocator(8 * (128 << 10), 128 << 10)  # one page of 8 largest chunks
    assert a.num_pages == 1 and a.region_bytes == 8 * (128 << 10)
    big = [a.alloc(128 << 10, f"b{i}") for i in range(8)]
    assert sorted(big) == [i * (128 << 10) for i in range(8)] and a.alloc(128 << 10, "x") is None
    assert a.alloc(1536, "small") is None  # the one page is of the large class
    for off in big:
        a.free(off)
    assert a.pages_used == 0 and a.bytes_allocated == 0 and a.rounding_bytes == 0
    small = [a.alloc(1536, i) for i in range(a.page_bytes // 1536)]  # now a page of small chunks
    assert None not in small and len(set(small)) == len(small) and a.alloc(1536, "y") is None
    assert a.owner_at(small[3]) == 3 and a.class_of(small[0]) == 1536
    with pytest.raises(ValueError):
        a.alloc((128 << 10) + 1, "too big")


def test_a_mix_of_three_sizes_loses_under_a_quarter_to_rounding():
    """Random puts and frees of the three test sizes, the allocator full most of the time:
    chunks never overlap, the accounting adds up, and what rounding costs (chunk past the
    object, page tails) stays under 25% of the capacity (the bound: about 1/9 + 1/16)."""
    a = ChunkAllocator(64 << 20, 128 << 10)
    rng = random.Random(7)
    live: dict = {}
    worst = 0.0
    for step in range(20000):
        n = rng.choice(MIX)
        off = a.alloc(n, step)
        if off is None or rng.random() < 0.3:
            if off is not None:
                live[off] = n
            for gone in rng.sample(sorted(live), min(len(live), 3)):  # frees, as evictions would
                a.free(gone)
                del live[gone]
        else:
            live[off] = n
        if a.bytes_allocated > 0.9 * a.region_bytes:
            worst = max(worst, a.rounding_bytes / a.region_bytes)
        if step % 1000 == 0:
            spans = sorted((o, o + chunk_bytes(m)) for o, m in live.items())
            assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:])) and spans[-1][1] <= a.region_bytes
            assert a.bytes_requested == sum(live.values())
    assert 0 < worst <= 0.25, worst


def test_claims_rebuild_the_pages_recovery_names():
    a = ChunkAllocator(32 * (64 << 10), 64 << 10)  # 4 pages of 8 chunks
    page = a.page_bytes
    assert a.claim(3 * (64 << 10), 64 << 10, "x")  # chunk 3 of page 0
    assert a.claim(page + 5 * 24576, 24576, "y")  # page 1 becomes the 24 KiB class
    assert not a.claim(page + 24576 + 100, 24576, "z")  # not a chunk boundary
    assert not a.claim(page, 64 << 10, "z")  # another class in page 1
    assert not a.claim(3 * (64 << 10), 64 << 10, "z")  # in use
    assert not a.claim(a.region_bytes, 1536, "z")  # outside
    # after the claims, allocation goes on around them
    got = {a.alloc(64 << 10, i) for i in range(7)}
    assert 3 * (64 << 10) not in got and len(got) == 7 and all(o < page for o in got)
    assert a.alloc(24576, "w") not in (None, page + 5 * 24576) and a.pages_used == 2
    a.free(page + 5 * 24576)
    assert a.owner_at(3 * (64 << 10)) == "x"


def test_the_index_steals_a_page_of_another_class_when_it_must():
    """A full index of small objects: a large object's reserve empties the page of the
    LRU object (its objects are evicted) and takes it; a page with a pinned object is
    passed over."""
    idx = SlotIndex(2 * 8 * (128 << 10), 128 << 10, high_watermark=1.0)  # 2 pages
    per_page = idx.alloc.page_bytes // 1536
    keys = [b"s%d" % i for i in range(2 * per_page)]
    for k in keys:
        code, obj = idx.reserve(k, 1536, "small", 1, 0.0, 30.0)
        assert code == RESERVED and idx.commit(k, obj.token, 1, 1)
    assert idx.alloc.pages_used == 2 and idx.evictions == 0
    first_page = {k for k in keys if idx.peek(k).offset < idx.alloc.page_bytes}
    pinned = next(iter(first_page))
    idx.get(pinned, "small", 2, 0.0, 30.0)  # a reader holds an object of the LRU page
    code, big = idx.reserve(b"big", 128 << 10, "large", 1, 0.0, 30.0)
    assert code == RESERVED and big.offset >= idx.alloc.page_bytes  # the other page went
    assert idx.evictions == per_page and all(idx.contains(k) for k in first_page)
    code, _ = idx.reserve(b"big2", 128 << 10, "large", 1, 0.0, 30.0)
    assert code == RESERVED and idx.evictions == per_page  # the large page's next chunk
    for i in range(6):
        idx.reserve(b"more%d" % i, 128 << 10, "large", 1, 0.0, 30.0)
    assert idx.reserve(b"full", 128 << 10, "large", 1, 0.0, 30.0)[0] == FULL  # pending, or a pin
