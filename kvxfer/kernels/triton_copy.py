"""Triton pool-to-pool copy: one launch moves blocks of one paged pool into another.

The same tiles as the pack kernel (:mod:`.triton_pack`): grid ``(num_ids, num_planes)``,
program ``(i, p)`` copies block ``src_ids[i]`` of wire plane ``p`` of the source pool
into block ``dst_ids[i]`` of the same plane of the destination pool, element for
element in the wire order ``[B, heads, D]``, without a wire buffer between them. Each
side has its own launch table (:class:`~.tables.PoolTables`: plane origin, block
stride and outer strides in words from that side's base pointer) and its own row
geometry, so any two layouts of one model (NHD and HND, per-layer and cross-layer,
different TP splits through a head range) meet in one launch.

Its use: a same-node peer copy (:mod:`kvxfer.transport.cuda_peer`), where one side is
the peer's pool mapped into this process (CUDA IPC), so a whole request moves with
one kernel. Words are the widest size every address, stride and row of *both*
sides divide; all offsets are int64.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from .triton_pack import _MAX_BLOCK_BYTES, _WORD_DTYPES


@triton.jit
def copy_blocks_kernel(
    src_ptr, dst_ptr, src_table_ptr, dst_table_ptr, src_ids_ptr, dst_ids_ptr,
    SS0: tl.constexpr, SS1: tl.constexpr, SS2: tl.constexpr, SROW: tl.constexpr,
    DS0: tl.constexpr, DS1: tl.constexpr, DS2: tl.constexpr, DROW: tl.constexpr,
    TILE: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    """Copy tile (src_ids[i] -> dst_ids[i], plane p). Sizes in words; table rows are
    [plane origin, block stride, outer stride 0, 1, 2] in words from each side's pointer."""
    i = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    s_entry = src_table_ptr + p * 5
    d_entry = dst_table_ptr + p * 5
    s_tile = tl.load(s_entry) + tl.load(src_ids_ptr + i) * tl.load(s_entry + 1)
    d_tile = tl.load(d_entry) + tl.load(dst_ids_ptr + i) * tl.load(d_entry + 1)
    so0 = tl.load(s_entry + 2)
    so1 = tl.load(s_entry + 3)
    so2 = tl.load(s_entry + 4)
    do0 = tl.load(d_entry + 2)
    do1 = tl.load(d_entry + 3)
    do2 = tl.load(d_entry + 4)
    for start in tl.range(0, TILE, BLOCK):
        w = start + tl.arange(0, BLOCK)
        rs = w // SROW
        src = s_tile + (rs // (SS1 * SS2)) * so0 + ((rs // SS2) % SS1) * so1 + (rs % SS2) * so2 + w % SROW
        rd = w // DROW
        dst = d_tile + (rd // (DS1 * DS2)) * do0 + ((rd // DS2) % DS1) * do1 + (rd % DS2) * do2 + w % DROW
        src = tl.max_contiguous(tl.multiple_of(src, VEC), VEC)
        dst = tl.max_contiguous(tl.multiple_of(dst, VEC), VEC)
        if TILE % BLOCK == 0:
            tl.store(dst_ptr + dst, tl.load(src_ptr + src))
        else:
            mask = w < TILE
            tl.store(dst_ptr + dst, tl.load(src_ptr + src, mask=mask), mask=mask)


_CONST_NAMES = ("SS0", "SS1", "SS2", "SROW", "DS0", "DS1", "DS2", "DROW", "TILE", "BLOCK", "VEC")
assert tuple(copy_blocks_kernel.arg_names[6:]) == _CONST_NAMES


def _word(src_table, dst_table) -> tuple:
    """(word bytes, vector width in words) both sides allow."""
    align = math.gcd(src_table.align, dst_table.align)
    top = min(src_table.base_nbytes, dst_table.base_nbytes)
    word = next(w for w in (8, 4, 2, 1) if align % w == 0 and w <= top)
    return word, (16 // word if align % 16 == 0 else 1)


def consts(src_table, dst_table, word: int, vec: int) -> dict:
    """The kernel's compile-time sizes for one pair of plane tables (in ``word``-byte words)."""
    tile = src_table.tile_bytes // word
    block = min(triton.next_power_of_2(tile), _MAX_BLOCK_BYTES // word)
    (ss0, ss1, ss2), (ds0, ds1, ds2) = src_table.outer_sizes, dst_table.outer_sizes
    return dict(SS0=ss0, SS1=ss1, SS2=ss2, SROW=src_table.row_bytes // word, DS0=ds0, DS1=ds1, DS2=ds2,
                DROW=dst_table.row_bytes // word, TILE=tile, BLOCK=block, VEC=vec)


class _Launch:
    """What a repeated copy launches with: both sides' table and ids entries, the sizes
    and, on CUDA, the compiled kernel (launched directly, without Triton's binding)."""

    __slots__ = ("entries", "args", "const_values", "consts", "grid", "kernel")

    def __init__(self, entries, args, consts_, grid) -> None:
        self.entries, self.args, self.consts, self.grid = entries, args, consts_, grid
        self.const_values = tuple(consts_[name] for name in _CONST_NAMES)
        self.kernel = None


MAX_COPIES = 8  # launches cached per source plan (one per destination plan it met)


def run(src, src_plan, dst, dst_plan) -> None:
    """Copy ``src_plan``'s blocks of ``src`` into ``dst_plan``'s blocks of ``dst``: both
    :class:`~.tables.Plan` of the same layers and heads and as many blocks, both pools on
    one device (a peer's pool mapped into this process counts as this process's device);
    validated by :func:`kvxfer.kernels.copy_blocks`. Asynchronous on GPU: queued on the
    current stream of that device (the caller holds the device guard)."""
    import torch

    from .tables import PoolTables

    n = src_plan.ids.size
    if n == 0:
        return
    s_tables, d_tables = PoolTables.of(src), PoolTables.of(dst)
    cuda = s_tables.cuda
    stream = torch.cuda.current_stream(src.device) if cuda else None
    launch = src_plan.copies.get(dst_plan)
    if launch is None:
        s_pt, d_pt = s_tables.plane_table(src_plan.heads), d_tables.plane_table(dst_plan.heads)
        word, vec = _word(s_pt, d_pt)
        dtype = getattr(torch, _WORD_DTYPES[word])
        s_entry, s_table = s_tables.table_entry(src_plan.heads, word, src_plan.layers, stream)
        d_entry, d_table = d_tables.table_entry(dst_plan.heads, word, dst_plan.layers, stream)
        s_ids, d_ids = s_tables.ids_entry(src_plan.ids, stream), d_tables.ids_entry(dst_plan.ids, stream)
        args = (s_tables.pool_words(word, dtype), d_tables.pool_words(word, dtype), s_table, d_table,
                s_ids.tensor, d_ids.tensor)
        launch = _Launch((s_entry, d_entry, s_ids, d_ids), args, consts(s_pt, d_pt, word, vec),
                         (n, len(src_plan.layers) * src.num_kv, 1))
        if len(src_plan.copies) >= MAX_COPIES:
            src_plan.copies.clear()
        src_plan.copies[dst_plan] = launch
    if cuda:
        raw = stream.cuda_stream
        for entry in launch.entries:
            if entry.raw != raw:  # built on another stream: wait for it, keep its memory for this one
                PoolTables._use(entry, stream)
        if launch.kernel is not None:
            try:
                launch.kernel[launch.grid](*launch.args, *launch.const_values, stream=raw)
                return
            except (TypeError, IndexError, AttributeError):  # a Triton whose launcher differs: bind as usual
                launch.kernel = None
    compiled = copy_blocks_kernel[launch.grid](*launch.args, **launch.consts, num_warps=4)
    if cuda and compiled is not None and hasattr(compiled, "packed_metadata"):
        launch.kernel = compiled
