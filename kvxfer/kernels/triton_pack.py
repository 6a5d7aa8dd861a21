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

from ..runs import CopyPlan

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


def launch_args(layout, plan: CopyPlan, wire):
    """Kernel arguments for ``plan``: (args tuple, constexpr dict, grid)."""
    import numpy as np
    import torch

    storages = [t.untyped_storage() for t in layout.tensors]
    base_storage = min(storages, key=lambda s: s.data_ptr())
    base = base_storage.data_ptr()
    quantities = [base, wire.data_ptr(), plan.row_bytes, *plan.plane_addrs.tolist(),
                  *plan.block_strides.tolist(), *plan.outer_strides.reshape(-1).tolist()]
    align = 0
    for q in quantities:
        align = math.gcd(align, int(q))
    # the base tensor is one word long (an empty tensor's data_ptr() is 0)
    word = next(w for w in (8, 4, 2, 1) if align % w == 0 and w <= base_storage.nbytes())
    vec = 16 // word if align % 16 == 0 else 1
    word_dtype = getattr(torch, _WORD_DTYPES[word])
    pool = torch.empty(0, dtype=word_dtype, device=layout.device).set_(base_storage, 0, (1,), (1,))
    table = np.concatenate([((plan.plane_addrs - base) // word)[:, None], (plan.block_strides // word)[:, None],
                            plan.outer_strides // word], axis=1)
    table = torch.from_numpy(np.ascontiguousarray(table)).to(layout.device)
    ids = torch.from_numpy(plan.ids).to(layout.device)
    tile = plan.tile_bytes // word
    block = min(triton.next_power_of_2(tile), _MAX_BLOCK_BYTES // word)
    consts = dict(S0=plan.outer_sizes[0], S1=plan.outer_sizes[1], S2=plan.outer_sizes[2],
                  ROW=plan.row_bytes // word, TILE=tile, BLOCK=block, VEC=vec)
    args = (pool, wire.view(word_dtype), table, ids, plan.ids.size)
    return args, consts, (plan.ids.size, plan.num_planes)


def triton_copy(layout, plan: CopyPlan, wire, *, to_wire: bool) -> None:
    """Launch the kernel on the current stream (asynchronous on GPU, like any launch)."""
    if plan.nbytes == 0:
        return
    args, consts, grid = launch_args(layout, plan, wire)
    copy_tiles_kernel[grid](*args, **consts, TO_WIRE=to_wire, num_warps=4)
