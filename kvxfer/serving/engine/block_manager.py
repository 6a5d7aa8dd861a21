"""KV block allocation: ref-counted blocks, an LRU free list, prefix hashing.

A full block is identified by a hash chained over the token ids of every
block up to and including it, so equal hashes mean equal prefixes (token ids
are also compared, so a collision is never a wrong hit). Blocks are hashed
only once their KV is in the pool (:meth:`BlockManager.cache_full_blocks`), so
a hit never returns a block whose KV is still being computed or received.
A freed block keeps its hash until it is reused: freed blocks are revived by a
later hit, and the least recently freed are reused first.

Cache events (:meth:`BlockManager.record_events`, used by the serving workers to
keep the router's prefix index current): a hash entering the cache
(:meth:`~BlockManager.cache_full_blocks`) is *stored*, a hash leaving it (its
block reused) is *removed*; :meth:`~BlockManager.drain_events` returns the net
change since the previous drain.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence as Seq

from kvxfer.errors import KVXferError

if TYPE_CHECKING:  # annotations only: the router hashes prompts without importing torch
    from .sequence import Sequence


class OutOfBlocks(KVXferError, MemoryError):
    """Not enough free KV blocks; check ``can_allocate``/``can_append`` first."""


class Block:
    """One KV block. While it has a hash, its tokens are ``token_ids[token_at:token_at + B]``:
    ``token_ids`` is the token list of the sequence that registered it (shared, not copied:
    a sequence's tokens are only ever appended to, so that slice never changes)."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "token_at")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] | tuple[()] = ()
        self.token_at = 0


_PACKERS: dict[int, struct.Struct] = {}  # by block length: a handful of sizes


def block_hash(token_ids: Seq[int], prefix_hash: int | None) -> int:
    """Chained 64-bit hash of one full block; stable across processes.

    BLAKE2b (8-byte digest) of the previous block's hash (0 for the first block) as
    8 bytes little-endian, then each token id as 4 bytes little-endian."""
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<Q{len(token_ids)}I")
    data = packer.pack(prefix_hash if prefix_hash is not None else 0, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class HashChain:
    """The chained hashes of one sequence's full blocks, computed once each.

    A sequence's tokens only grow, so block ``i``'s hash never changes once the block
    is full: :meth:`upto` extends the memo and returns it. Kept on the sequence
    (``Sequence.hash_chain``); sequences of one prompt may share one. ``hashes``: the
    hashes of the first full blocks where they are already known (copied), e.g. from
    another chain of the same tokens."""

    __slots__ = ("block_size", "hashes")

    def __init__(self, block_size: int, hashes: Seq[int] = ()) -> None:
        self.block_size = block_size
        self.hashes: list[int] = list(hashes)

    def upto(self, token_ids: Seq[int], num_blocks: int) -> list[int]:
        """The memo, holding at least the hashes of the first ``num_blocks`` full blocks of
        ``token_ids`` (the sequence's tokens; ``num_blocks`` of them must be full)."""
        hashes, size = self.hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(block_hash(token_ids[i * size:(i + 1) * size],
                                     hashes[-1] if hashes else None))
        return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # insertion order = LRU; an OrderedDict, as taking the oldest of a plain dict
        # whose head was deleted scans the deleted slots (quadratic over a run)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._events: dict[int, bool] | None = None  # hash -> in the cache now (since the last drain)
        # match_prefix's last match: (token_ids, chain, block ids), and block id -> position
        self._match: tuple | None = None
        self._match_at: dict[int, int] = {}
        # prefix-cache effect, summed over allocate(): tokens asked for, tokens found cached
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def record_events(self) -> None:
        """Start recording cache events for :meth:`drain_events` (module docstring)."""
        if self._events is None:
            self._events = {}

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache now (at most ``num_blocks``)."""
        return list(self._hash_to_block)

    def drain_events(self) -> tuple[list[int], list[int]]:
        """``(stored, removed)``: the hashes that entered and left the cache since the
        last drain (net: a hash is in one list at most). The caller must drain
        regularly (the workers do every step): at most one entry a hash touched."""
        events = self._events
        if not events:
            return [], []
        self._events = {}
        stored = [h for h, is_in in events.items() if is_in]
        return stored, [h for h, is_in in events.items() if not is_in]

    def match_prefix(self, token_ids: Seq[int],
                     chain: HashChain | None = None) -> tuple[list[int], list[int]]:
        """Cached blocks holding a prefix of ``token_ids``: ``(block_ids, hashes)``.

        The last token is never covered, so a prefill always has a token to run.
        ``chain``: the tokens' :class:`HashChain` (each hash computed once; a fresh one
        if None). Hashes are computed only as far as the match goes.

        With a ``chain``, the match is remembered for the next call with the same
        ``token_ids`` object and chain (a waiting sequence is asked about every step):
        that call walks on from where this one stopped. Valid because a cached block
        leaves the cache only through :meth:`_fresh_blocks`, which cuts the remembered
        match at that block; entries are only ever added otherwise, and a cached
        block's tokens never change while it is cached.
        """
        if not self.enable_prefix_caching:
            return [], []
        if type(token_ids) is not list:  # compared with the blocks' token lists below
            token_ids = list(token_ids)
        size = self.block_size
        memo = self._match
        if chain is None:
            chain, ids = HashChain(size), []
        elif memo is not None and memo[0] is token_ids and memo[1] is chain:
            ids = memo[2]
        else:
            ids = []
            self._match, self._match_at = (token_ids, chain, ids), {}
        hashes, blocks, at = chain.hashes, self.blocks, self._match_at
        get = self._hash_to_block.get
        for i in range(len(ids), (len(token_ids) - 1) // size):
            bid = get(hashes[i] if i < len(hashes) else chain.upto(token_ids, i + 1)[i])
            if bid is None:
                break
            block, start = blocks[bid], blocks[bid].token_at
            if block.token_ids[start:start + size] != token_ids[i * size:(i + 1) * size]:
                break
            ids.append(bid)
            at[bid] = i
        return ids[:], hashes[:len(ids)]

    def chain(self, seq: Sequence) -> HashChain:
        """``seq``'s :class:`HashChain` for this manager's block size (made on first use)."""
        chain = seq.hash_chain
        if chain is None or chain.block_size != self.block_size:
            chain = seq.hash_chain = HashChain(self.block_size)
        return chain

    def _blocks_needed(self, seq: Sequence) -> tuple[list[int], list[int], int]:
        hits, hashes = self.match_prefix(seq.token_ids, self.chain(seq))
        revived = sum(map(self._free.__contains__, hits))  # free <=> ref_count == 0
        return hits, hashes, seq.num_blocks(self.block_size) - len(hits) + revived

    def can_allocate(self, seq: Sequence) -> bool:
        return self._blocks_needed(seq)[2] <= len(self._free)

    def _fresh_block(self) -> int:
        return self._fresh_blocks(1)[0]

    def _fresh_blocks(self, num: int) -> list[int]:
        """``num`` free blocks, least recently freed first, referenced once each; a block
        still cached leaves the cache (its hash forgotten, a *removed* event, the remembered
        match cut before it)."""
        free, blocks, cache, events = self._free, self.blocks, self._hash_to_block, self._events
        take = free.popitem
        ids = []
        for _ in range(num):
            bid = take(last=False)[0]  # the least recently freed
            block = blocks[bid]
            block.ref_count = 1
            h = block.hash
            if h is None:  # never cached (its token_ids are () too)
                ids.append(bid)
                continue
            if cache.get(h) == bid:
                del cache[h]
                if events is not None:
                    events[h] = False
                at = self._match_at.get(bid)
                if at is not None and at < len(self._match[2]) and self._match[2][at] == bid:
                    del self._match[2][at:]  # the remembered match ends before this block
            block.hash, block.token_ids = None, ()
            ids.append(bid)
        return ids

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks.

        Sets ``block_table``, ``block_hashes`` and ``num_cached_tokens`` =
        ``num_computed_tokens`` (the reused prefix), and counts them in
        ``num_query_tokens``/``num_hit_tokens``. Raises :class:`OutOfBlocks`.
        """
        if seq.block_table:
            raise ValueError(f"{seq!r} already has blocks")
        hits, hashes, needed = self._blocks_needed(seq)
        if needed > len(self._free):
            raise OutOfBlocks(f"{seq.request_id}: needs {needed} free blocks, {len(self._free)} free")
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]  # revived from the free list
            block.ref_count += 1
        seq.block_table = hits + self._fresh_blocks(seq.num_blocks(self.block_size) - len(hits))
        seq.block_hashes = hashes
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.num_query_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; unreferenced blocks become free (hash kept)."""
        blocks, free = self.blocks, self._free
        for bid in reversed(seq.block_table):  # tail first: evicted before the shared head
            block = blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                free[bid] = None
        seq.block_table, seq.block_hashes = [], []
        seq.num_cached_tokens = seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode step of ``seq`` fits (a new block if its last is full)."""
        return len(seq.block_table) >= seq.num_blocks(self.block_size) or len(self._free) > 0

    def append_slot(self, seq: Sequence) -> None:
        """Grow ``seq``'s block table to hold all its tokens (at most one new block)."""
        while len(seq.block_table) < seq.num_blocks(self.block_size):
            if not self._free:
                raise OutOfBlocks(f"{seq.request_id}: no free block to grow into")
            seq.block_table.append(self._fresh_block())

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s full blocks whose KV is now in the pool."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = seq.num_computed_tokens // size
        registered = seq.block_hashes
        first = len(registered)
        if first >= num_full:
            return
        hashes = self.chain(seq).upto(seq.token_ids, num_full)[first:num_full]
        tokens, blocks = seq.token_ids, self.blocks
        store, events = self._hash_to_block.setdefault, self._events
        for h, bid, at in zip(hashes, seq.block_table[first:num_full],
                              range(first * size, num_full * size, size)):
            block = blocks[bid]
            if block.hash is None:
                block.hash, block.token_ids, block.token_at = h, tokens, at
                if store(h, bid) == bid and events is not None:
                    events[h] = True
        registered.extend(hashes)

    def check_invariants(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent (for tests)."""
        for block in self.blocks:
            assert block.ref_count >= 0, block.block_id
            assert (block.ref_count == 0) == (block.block_id in self._free), block.block_id
        for h, bid in self._hash_to_block.items():
            assert self.blocks[bid].hash == h, (h, bid)
        if self._match is not None:  # the remembered match is a prefix of a fresh one
            token_ids, _, ids = self._match
            assert self.match_prefix(token_ids)[0][:len(ids)] == ids, ids
