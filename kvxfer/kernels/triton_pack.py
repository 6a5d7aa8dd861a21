"""Triton pack/unpack: one launch copies every selected (layer, kv) plane.

Grid ``(num_ids, num_planes)``; program ``(i, p)`` copies one tile (block
``ids[i]`` of wire plane ``p``, ``B * heads * D * itemsize`` bytes) between
engine memory and wire slot ``p * num_ids + i``. Engine addresses come from a
per-plane table of int64 word offsets from one base pointer (the lowest
storage of the pool), so per-layer tensors, cross-layer pools and views share
one kernel. Copies move *words* (8, 4, 2 or 1 bytes, the widest that every
address, stride and row divides), so any dtype is bit-exact; when everything
is 16-byte aligned the hints below let the compiler emit 16-byte vector
loads/stores. All offsets are int64.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from ..runs import TileCopy

_WORD_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}
_MAX_BLOCK_BYTES = 8192


@triton.jit
def copy_tiles_kernel(
    pool_ptr, wire_ptr, table_ptr, ids_ptr, num_ids,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, ROW: tl.constexpr, TILE: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr, TO_WIRE: tl.constexpr,
):
    """Copy tile (ids[i], plane p). Sizes ROW/TILE/BLOCK/VEC are in words; table rows
    are [plane origin, block stride, outer stride 0, 1, 2] in words from ``pool_ptr``."""
    i = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    entry = table_ptr + p * 5
    block = tl.load(ids_ptr + i)
    eng_tile = tl.load(entry) + block * tl.load(entry + 1)
    o0 = tl.load(entry + 2)
    o1 = tl.load(entry + 3)
    o2 = tl.load(entry + 4)
    wire_tile = (p * num_ids + i) * TILE
    for start in tl.range(0, TILE, BLOCK):
        w = start + tl.arange(0, BLOCK)
        r = w // ROW
        eng = eng_tile + (r // (S1 * S2)) * o0 + ((r // S2) % S1) * o1 + (r % S2) * o2 + w % ROW
        eng = tl.max_contiguous(tl.multiple_of(eng, VEC), VEC)
        wire = tl.max_contiguous(tl.multiple_of(wire_tile + w, VEC), VEC)
        if TILE % BLOCK == 0:
            if TO_WIRE:
                tl.store(wire_ptr + wire, tl.load(pool_ptr + eng))
            else:
                tl.store(pool_ptr + eng, tl.load(wire_ptr + wire))
        else:
            mask = w < TILE
            if TO_WIRE:
                tl.store(wire_ptr + wire, tl.load(pool_ptr + eng, mask=mask), mask=mask)
            else:
                tl.store(pool_ptr + eng, tl.load(wire_ptr + wire, mask=mask), mask=mask)


def _word(align: int, wire_ptr: int, base_nbytes: int) -> tuple:
    """(word bytes, vector width in words): the widest word every address, stride and the
    row divide (at most the base storage's size: its tensor is one word long)."""
    align = math.gcd(align, int(wire_ptr))
    word = next(w for w in (8, 4, 2, 1) if align % w == 0 and w <= base_nbytes)
    return word, (16 // word if align % 16 == 0 else 1)


def launch_args(layout, job: TileCopy, wire):
    """Kernel arguments for ``job``: (args tuple, constexpr dict, grid). Host tensors
    (tests and the CPU interpreter); the device path is :func:`copy`."""
    import numpy as np
    import torch

    from .tables import PoolTables

    tables = PoolTables.of(layout)
    ptable = tables.plane_table(job.heads)
    word, vec = _word(ptable.align, wire.data_ptr(), ptable.base_nbytes)
    rows = np.array([l * layout.num_kv + k for l in job.layers for k in range(layout.num_kv)], dtype=np.int64)
    table = ptable.table_bytes[rows].copy()
    table[:, 0] -= ptable.base
    word_dtype = getattr(torch, _WORD_DTYPES[word])
    consts = _consts(ptable, word, vec)
    args = (tables.pool_words(word, word_dtype), wire.view(word_dtype), torch.from_numpy(table // word),
            torch.from_numpy(job.ids.copy()), job.ids.size)
    return args, consts, (job.ids.size, job.num_planes)


def _consts(ptable, word: int, vec: int) -> dict:
    tile = ptable.tile_bytes // word
    block = min(triton.next_power_of_2(tile), _MAX_BLOCK_BYTES // word)
    s0, s1, s2 = ptable.outer_sizes
    return dict(S0=s0, S1=s1, S2=s2, ROW=ptable.row_bytes // word, TILE=tile, BLOCK=block, VEC=vec)


def copy(layout, ids, layers: tuple, heads: tuple, wire, *, to_wire: bool) -> None:
    """Launch one copy of validated ``ids`` (int64 numpy), ``layers`` and ``heads`` between the
    pool and ``wire`` (uint8, exactly the wire bytes) on the current stream of the pool's device.

    Asynchronous on GPU, like any launch; call it under :func:`device_guard` (the caller
    allocated ``wire`` there too, see :func:`~kvxfer.kernels.common.device_guard`). Tables and ids come from the device caches
    (:mod:`kvxfer.kernels.tables`), so a call builds no table and copies nothing host->device
    once its request's ids were seen.
    """
    import torch

    from .tables import PoolTables

    if ids.size == 0:
        return
    tables = PoolTables.of(layout)
    ptable = tables.plane_table(heads)
    word, vec = _word(ptable.align, wire.data_ptr(), ptable.base_nbytes)
    stream = torch.cuda.current_stream(layout.device) if tables.cuda else None
    table = tables.table(heads, word, layers, stream)
    dev_ids = tables.ids(ids, stream)
    word_dtype = getattr(torch, _WORD_DTYPES[word])
    copy_tiles_kernel[(ids.size, len(layers) * layout.num_kv)](
        tables.pool_words(word, word_dtype), wire.view(word_dtype), table, dev_ids, ids.size,
        **_consts(ptable, word, vec), TO_WIRE=to_wire, num_warps=4)


def triton_copy(layout, job: TileCopy, wire, *, to_wire: bool) -> None:
    """Launch the kernel for ``job`` on the current stream of the pool's device."""
    if job.nbytes == 0:
        return
    from .common import device_guard

    with device_guard(layout.device):
        copy(layout, job.ids, tuple(job.layers), tuple(job.heads), wire, to_wire=to_wire)
