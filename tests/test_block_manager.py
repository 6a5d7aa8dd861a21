"""Block manager: ref counts, free list, prefix hashing (no model needed)."""
import random

import pytest

from kvxfer.serving.engine.block_manager import BlockManager, OutOfBlocks, block_hash
from kvxfer.serving.engine.sequence import Sequence

B = 4


def seq(tokens):
    return Sequence(list(tokens))


def computed(bm, s):
    """Pretend the model computed every token but the last (a prefill)."""
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_and_free_restore_pool():
    bm = BlockManager(8, B)
    s = seq(range(10))  # 3 blocks
    bm.allocate(s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5 and s.num_cached_tokens == 0
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    bm.deallocate(s)
    assert bm.num_free_blocks == 8 and s.block_table == []
    bm.check_invariants()


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(16, B)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    assert bm.match_prefix(a.token_ids) == ([], [])  # not hashed before KV is computed
    computed(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    bm.deallocate(a)
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]
    bm.check_invariants()


def test_hash_chain_depends_on_prefix():
    assert block_hash([1, 2, 3, 4], None) != block_hash([1, 2, 3, 4], block_hash([0, 0, 0, 0], None))
    assert block_hash([1, 2, 3, 4], 7) == block_hash((1, 2, 3, 4), 7)
    bm = BlockManager(16, B)
    a = seq([9, 9, 9, 9, 1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    # same second block, different first block: no hit
    b = seq([8, 8, 8, 8, 1, 2, 3, 4, 5])
    assert bm.match_prefix(b.token_ids) == ([], [])


def test_last_token_never_covered_by_hit():
    bm = BlockManager(16, B)
    a = seq(range(8))  # exactly two full blocks
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(8))
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the block holding the last token is recomputed
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_freed_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(4, B)
    a = seq(range(9))  # 3 blocks
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    b = seq(list(range(8)) + [99])
    assert bm.can_allocate(b)
    bm.allocate(b)  # revives a's two full blocks from the free list
    assert b.num_cached_tokens == 8 and bm.num_free_blocks == 1
    bm.deallocate(b)
    c = seq(range(100, 116))  # 4 fresh blocks: evicts everything cached
    bm.allocate(c)
    assert bm.match_prefix(b.token_ids) == ([], [])
    bm.check_invariants()


def test_out_of_blocks_and_can_allocate():
    bm = BlockManager(2, B)
    s = seq(range(9))
    assert not bm.can_allocate(s)
    with pytest.raises(OutOfBlocks):
        bm.allocate(s)
    assert bm.num_free_blocks == 2
    with pytest.raises(ValueError):
        BlockManager(0, B)


def test_append_slot_grows_at_block_boundary():
    bm = BlockManager(3, B)
    s = seq(range(4))
    bm.allocate(s)
    computed(bm, s)
    s.token_ids.append(5)  # 5th token needs a second block
    assert bm.can_append(s)
    bm.append_slot(s)
    assert len(s.block_table) == 2
    s.token_ids.extend([6, 7, 8])
    bm.append_slot(s)
    assert len(s.block_table) == 2  # still fits
    s.token_ids.append(9)
    bm.append_slot(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 0
    s.token_ids.extend([1, 2, 3, 4])
    assert not bm.can_append(s)
    with pytest.raises(OutOfBlocks):
        bm.append_slot(s)


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    bm = BlockManager(24, B)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            bm.deallocate(live.pop(rng.randrange(len(live))))
        else:
            s = seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            if bm.can_allocate(s):
                bm.allocate(s)
                assert s.num_cached_tokens % B == 0 and s.num_cached_tokens < s.num_tokens
                computed(bm, s)
                live.append(s)
        bm.check_invariants()
        in_use = sum(1 for b in bm.blocks if b.ref_count)
        assert in_use + bm.num_free_blocks == 24
        refs = sum(b.ref_count for b in bm.blocks)
        assert refs == sum(len(s.block_table) for s in live)


def test_remembered_match_grows_and_is_cut_as_the_cache_changes():
    bm = BlockManager(6, B)
    a = seq(range(13))  # blocks 0-3, three of them full
    bm.allocate(a)
    r = seq(range(100, 104))  # a running sequence: block 4
    bm.allocate(r)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)  # only a's first block cached so far
    waiting = seq(list(range(12)) + [99])
    chain = bm.chain(waiting)
    assert bm.match_prefix(waiting.token_ids, chain)[0] == [0]
    computed(bm, a)  # the rest of a's full blocks: the remembered match walks on
    assert bm.match_prefix(waiting.token_ids, chain)[0] == [0, 1, 2]
    bm.deallocate(a)  # free, least recent first: 5, then a's blocks tail first (3, 2, 1, 0)
    r.token_ids.extend(range(104, 116))
    bm.append_slot(r)  # r grows into 5, 3 and 2: a's third block leaves the cache
    assert r.block_table == [4, 5, 3, 2]
    hits, hashes = bm.match_prefix(waiting.token_ids, chain)
    assert hits == [0, 1]  # the remembered match was cut where its block left the cache
    assert (hits, hashes) == bm.match_prefix(list(waiting.token_ids))  # as a fresh walk
    bm.check_invariants()


def test_remembered_match_equals_a_fresh_walk_under_random_traffic():
    rng = random.Random(1)
    bm = BlockManager(16, B)
    prefixes = [[rng.randrange(20) for _ in range(12)] for _ in range(3)]
    waiting = [seq(p + [rng.randrange(20) for _ in range(5)]) for p in prefixes]
    live = []
    for _ in range(600):
        op = rng.random()
        if live and op < 0.3:
            bm.deallocate(live.pop(rng.randrange(len(live))))
        elif live and op < 0.8:  # a running sequence decodes: new blocks evict cached ones
            s = rng.choice(live)
            s.token_ids.extend(rng.randrange(20) for _ in range(rng.randrange(1, 6)))
            if bm.can_append(s) and bm.num_free_blocks >= s.num_blocks(B) - len(s.block_table):
                bm.append_slot(s)
                s.num_computed_tokens = s.num_tokens - 1
                bm.cache_full_blocks(s)
            else:
                bm.deallocate(live.pop(live.index(s)))
        else:
            s = seq(rng.choice(prefixes)[:rng.randrange(1, 13)] + [rng.randrange(20) for _ in range(4)])
            if bm.can_allocate(s):
                bm.allocate(s)
                s.num_computed_tokens = rng.randrange(s.num_cached_tokens, s.num_tokens + 1)
                bm.cache_full_blocks(s)
                live.append(s)
        if rng.random() < 0.05:  # mostly the same one at the head of the queue
            rng.shuffle(waiting)
        w = waiting[0]  # a waiting sequence asked about every step, as the scheduler does
        assert bm.match_prefix(w.token_ids, bm.chain(w)) == bm.match_prefix(list(w.token_ids))
        bm.check_invariants()


def test_a_hash_collision_is_no_hit_and_grown_sequences_keep_their_blocks_tokens():
    """A cached block's tokens are a slice of the registering sequence's own list (not a
    copy): they are compared on every hit, so equal hashes of other tokens miss, and they
    stay right while that sequence grows by decoding and after it is freed."""
    bm = BlockManager(16, B)
    a = seq(range(100, 109))
    bm.allocate(a)
    computed(bm, a)  # blocks 0-1 cached
    for t in range(7):  # decoding: a grows past another full block
        bm.append_slot(a)
        a.token_ids.append(200 + t)
        a.num_computed_tokens = a.num_tokens - 1
        bm.cache_full_blocks(a)
    table = list(a.block_table)
    bm.deallocate(a)
    b = seq(list(range(100, 109)) + [200, 201, 202, 7])
    assert bm.match_prefix(b.token_ids)[0] == table[:3]
    # a collision: another prompt's first-block hash mapped to a's first block
    c = seq([1, 2, 3, 4, 5])
    bm._hash_to_block[block_hash([1, 2, 3, 4], None)] = table[0]
    assert bm.match_prefix(c.token_ids) == ([], [])
