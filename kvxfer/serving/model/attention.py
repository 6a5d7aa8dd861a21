"""Paged attention over :class:`~kvxfer.serving.model.kv_cache.KVCache`.

A step runs a list of :class:`Chunk` s (one per sequence): a prefill chunk is
many tokens of one prompt (``start_pos > 0`` when a prefix is already in the
cache), a decode chunk is one token. New K/V are written into their slots,
then each sequence attends over its own blocks, gathered through its block
table: all one-token (decode) chunks of a step together in one batched
matmul, each longer (prefill) chunk on its own. A sequence's result does not
depend on which other sequences share the step, nor on which physical blocks
hold its KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

# Row-invariance of the projections (a token's bits never depend on the batch it
# ran in) is kept by kvxfer.serving.model.linear: every GEMM call has a fixed
# row count (ROW_TILE), whatever the step's row count.


@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence to run in one step.

    ``token_ids`` sit at positions ``start_pos .. start_pos + len(token_ids) - 1``;
    positions ``< start_pos`` must already be in the cache. ``block_table`` lists
    the physical blocks holding positions ``0..``, and must cover the chunk's end.
    """

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "block_table", tuple(int(b) for b in self.block_table))
        if not self.token_ids:
            raise ValueError("a chunk needs at least one token")
        if not isinstance(self.start_pos, int) or self.start_pos < 0:
            raise ValueError(f"start_pos must be an int >= 0, got {self.start_pos!r}")

    @property
    def end_pos(self) -> int:
        """One past the last position (the context length after this chunk)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class _SeqSlice:
    row: int  # first row of this chunk in the step's token rows
    num_tokens: int
    start_pos: int
    block_ids: torch.Tensor  # [nb] long


class _SingleGroup:
    """One-token chunks that attend together: ``rows`` index the step's one-token chunks;
    ``tables`` ``[G, nb]`` (padded with block 0), ``mask`` ``[G, 1, 1, nb*B]`` True past
    each sequence's context."""

    def __init__(self, rows: list[int], seqs: list[_SeqSlice], block_size: int) -> None:
        width = max(len(s.block_ids) for s in seqs)
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.tables = torch.stack([F.pad(s.block_ids, (0, width - len(s.block_ids))) for s in seqs])
        ctx = torch.tensor([s.start_pos + 1 for s in seqs])
        self.mask = (torch.arange(width * block_size) >= ctx[:, None])[:, None, None, :]


def _width_groups(widths: list[int]) -> list[list[int]]:
    """Indices of ``widths`` grouped so no member is padded past twice its own width.

    Decode attention pads a group's block tables to its widest member; one long
    context in a batch of short ones would otherwise make every sequence attend
    over the long one's length. Groups are power-of-two width classes, in
    ascending order of width; padding never changes a sequence's bits (masked
    positions are exact zeros), so grouping is invisible in the results.
    """
    classes: dict[int, list[int]] = {}
    for index, width in enumerate(widths):
        classes.setdefault(max(width - 1, 0).bit_length(), []).append(index)
    return [classes[k] for k in sorted(classes)]


class StepBatch:
    """Tensors for one step, built from chunks.

    ``input_ids``/``positions``: ``[T]`` (one row per chunk token);
    ``slot_blocks``/``slot_offsets``: ``[T]`` where each new token's K/V goes;
    ``last_rows``: ``[S]`` the row of each chunk's last token, in chunk order. Rows
    hold the one-token chunks first (``num_single`` rows), then the longer chunks.
    """

    def __init__(self, chunks: Sequence[Chunk], *, block_size: int, num_blocks: int,
                 max_position: int) -> None:
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        ids: list[int] = []
        positions: list[int] = []
        self.seqs: list[_SeqSlice] = []
        last_rows = [0] * len(chunks)
        for chunk in chunks:
            if not isinstance(chunk, Chunk):
                raise TypeError(f"expected Chunk, got {type(chunk).__name__}")
        # rows of one-token chunks first (they run in ROW_TILE projection calls, the
        # longer chunks' rows after them in PROMPT_TILE calls; kvxfer.serving.model.linear)
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) > 1)
        for index in order:
            chunk = chunks[index]
            if chunk.end_pos > max_position:
                raise ValueError(f"position {chunk.end_pos - 1} exceeds the model's "
                                 f"context length {max_position}")
            needed = -(-chunk.end_pos // block_size)
            if len(chunk.block_table) < needed:
                raise ValueError(f"block table of {len(chunk.block_table)} blocks cannot hold "
                                 f"{chunk.end_pos} tokens (block size {block_size})")
            table = chunk.block_table[:needed]
            if min(table) < 0 or max(table) >= num_blocks:
                raise ValueError(f"block ids must lie in [0, {num_blocks}), got {list(table)}")
            self.seqs.append(_SeqSlice(len(ids), len(chunk.token_ids), chunk.start_pos,
                                       torch.tensor(table, dtype=torch.long)))
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            last_rows[index] = len(ids) - 1
        self.num_tokens = len(ids)
        pos = torch.tensor(positions, dtype=torch.long)
        blocks = torch.cat([s.block_ids for s in self.seqs])
        starts = torch.tensor([0] + [len(s.block_ids) for s in self.seqs[:-1]]).cumsum(0)
        seq_of_row = torch.repeat_interleave(torch.arange(len(self.seqs)),
                                             torch.tensor([s.num_tokens for s in self.seqs]))
        self.slot_blocks = blocks[starts[seq_of_row] + pos // block_size]
        self.slot_offsets = pos % block_size
        self.input_ids = torch.tensor(ids, dtype=torch.long)
        self.positions = pos
        self.last_rows = torch.tensor(last_rows, dtype=torch.long)
        # one-token chunks (decode) attend together; longer chunks one by one
        self.multi = [s for s in self.seqs if s.num_tokens > 1]
        single = [s for s in self.seqs if s.num_tokens == 1]
        self.num_single = len(single)  # rows 0 .. num_single-1: the one-token chunks
        self.single_rows = torch.tensor([s.row for s in single], dtype=torch.long)
        self.single_groups = [_SingleGroup(rows, [single[i] for i in rows], block_size)
                              for rows in _width_groups([len(s.block_ids) for s in single])]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
            scale: float) -> torch.Tensor:
    """Causal GQA attention of ``q`` ``[n, Hq, D]`` (positions ``start_pos..``) over
    ``k``/``v`` ``[ctx, Hkv, D]`` (positions ``0..ctx-1``); returns ``[n, Hq, D]``.

    torch's fused CPU flash kernel (blocked, no ``[n, ctx]`` score matrix in
    memory); a chunk after a cached prefix gets an explicit bottom-right causal
    mask. The kernel needs 4-D ``[1, H, n, D]`` operands with as many kv heads
    as query heads (3-D or ``enable_gqa`` inputs fall back to torch's unfused
    math path, 5x slower at 1,000 tokens), so k/v are repeated per group.
    """
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = None
    if start_pos:
        mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(start_pos, start_pos + n).unsqueeze(1)
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                         is_causal=not start_pos, scale=scale)
    return out[0].transpose(0, 1)


def _attend_single(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                   batch: StepBatch, scale: float) -> torch.Tensor:
    """Attention of every one-token chunk at once: ``q`` ``[S1, Hq, D]`` -> ``[S1, Hq, D]``.

    Each sequence's keys are gathered through its block table, padded to the
    longest table of its width group (:func:`_width_groups`) and masked past its
    context. Masked positions
    contribute exact zeros, so a sequence's result does not depend on which
    others share the step (tests/test_serving_model.py checks this bitwise).
    """
    groups = batch.single_groups
    if len(groups) == 1:
        return _attend_group(q, cache_k, cache_v, groups[0], scale)
    out = torch.empty_like(q)
    for g in groups:  # sequences of similar context length (see _width_groups)
        out[g.rows] = _attend_group(q[g.rows], cache_k, cache_v, g, scale)
    return out


def _attend_group(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  g: _SingleGroup, scale: float) -> torch.Tensor:
    """``q`` ``[G, Hq, D]`` of one group's sequences -> ``[G, Hq, D]``."""
    s1, num_heads, head_dim = q.shape
    num_kv_heads = cache_k.shape[2]
    group = num_heads // num_kv_heads
    # One row gather per operand ([G, L, Hkv, D], whole blocks copied as they lie);
    # then per kv head a bmm over strided [G, L, D] views: no transposing copy.
    keys = torch.index_select(cache_k, 0, g.tables.flatten()).view(s1, -1, num_kv_heads, head_dim)
    values = torch.index_select(cache_v, 0, g.tables.flatten()).view(s1, -1, num_kv_heads, head_dim)
    length = keys.shape[1]
    qh = q.view(s1, num_kv_heads, group, head_dim)
    out = q.new_empty((s1, num_kv_heads, group, head_dim))
    for h in range(num_kv_heads):
        scores = torch.bmm(qh[:, h], keys[:, :, h].transpose(1, 2)) * scale  # [G, group, L]
        probs = torch.softmax(scores.masked_fill(g.mask[:, 0], float("-inf")), dim=-1)
        torch.bmm(probs, values[:, :, h], out=out[:, h])  # [G, group, D]
    return out.view(s1, num_heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                    cache_v: torch.Tensor, batch: StepBatch, scale: float) -> torch.Tensor:
    """Write new K/V into the cache, then attend per sequence through its block table.

    ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (rotary applied);
    ``cache_k``/``cache_v`` ``[N, B, Hkv, D]`` views of one layer. Returns
    ``[T, Hq, D]``.
    """
    t = batch.num_tokens
    cache_k[batch.slot_blocks, batch.slot_offsets] = k[:t]
    cache_v[batch.slot_blocks, batch.slot_offsets] = v[:t]
    if not batch.multi:  # decode only: rows are the one-token chunks in order
        return _attend_single(q, cache_k, cache_v, batch, scale)
    out = torch.zeros_like(q)
    if len(batch.single_rows):
        out[batch.single_rows] = _attend_single(q[batch.single_rows], cache_k, cache_v, batch,
                                                scale)
    for s in batch.multi:
        ctx = s.start_pos + s.num_tokens
        keys = cache_k[s.block_ids].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        values = cache_v[s.block_ids].flatten(0, 1)[:ctx]
        out[s.row:s.row + s.num_tokens] = _attend(q[s.row:s.row + s.num_tokens], keys, values,
                                                  s.start_pos, scale)
    return out
