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


# the kernel's parameters after its five runtime arguments, TO_WIRE last: a compiled
# kernel takes every parameter positionally, in this order
_CONST_NAMES = ("S0", "S1", "S2", "ROW", "TILE", "BLOCK", "VEC")
assert tuple(copy_tiles_kernel.arg_names[5:]) == (*_CONST_NAMES, "TO_WIRE")


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


class _WordState:
    """What a :class:`~kvxfer.kernels.tables.Plan` launches with for one (word, vector) size."""

    __slots__ = ("table_entry", "table", "ids_entry", "ids", "dtype", "consts", "const_values", "kernels",
                 "direct")

    def __init__(self, tables, plan, word: int, vec: int, stream) -> None:
        import torch

        ptable = tables.plane_table(plan.heads)
        self.table_entry, self.table = tables.table_entry(plan.heads, word, plan.layers, stream)
        self.ids_entry = tables.ids_entry(plan.ids, stream)
        self.ids = self.ids_entry.tensor
        self.dtype = getattr(torch, _WORD_DTYPES[word])
        self.consts = _consts(ptable, word, vec)
        self.const_values = tuple(self.consts[name] for name in _CONST_NAMES)  # the launcher's order
        self.kernels: dict = {}  # (TO_WIRE, wire 16-byte aligned) -> compiled kernel
        self.direct = True  # launch the compiled kernels directly (False once a launcher refused)


def run(layout, block_ids, layers, heads, buf, *, to_wire: bool):
    """Pack (``to_wire``; ``buf`` None allocates) or unpack ``block_ids`` of ``layers`` and
    ``heads`` between the pool and ``buf`` (uint8, at least the wire bytes; the first
    ``wire_nbytes`` are used). Returns the wire bytes (uint8 ``[wire_nbytes]``, a view of
    ``buf`` when given).

    Asynchronous on GPU, like any launch: queued on the current stream of the pool's
    device, under that device whatever the thread's current device is. A repeated call
    (same ids, layers and heads: every layer of a request) reuses its
    :class:`~kvxfer.kernels.tables.Plan`: no validation, no table, no host->device copy,
    and the compiled kernel launches directly, without Triton's argument binding.
    """
    import torch

    from .common import device_guard
    from .tables import PoolTables

    tables = PoolTables.of(layout)
    plan = tables.plan(block_ids, layers, heads, unique=not to_wire)
    cuda = tables.cuda
    if cuda and torch.cuda.current_device() == layout.device.index:
        return _run(tables, plan, layout, buf, to_wire, cuda)
    with device_guard(layout.device):
        return _run(tables, plan, layout, buf, to_wire, cuda)


def _run(tables, plan, layout, buf, to_wire: bool, cuda: bool):
    import torch

    from .common import check_buffer

    if buf is None:
        buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=layout.device)
    else:
        check_buffer(layout, plan.nbytes, buf, "out" if to_wire else "buf")
        if buf.dim() != 1 or buf.numel() != plan.nbytes:
            buf = buf.reshape(-1)[:plan.nbytes]
    n = plan.ids.size
    if n == 0:
        return buf
    ptable = tables.plane_table(plan.heads)
    wire_ptr = buf.data_ptr()
    word, vec = _word(ptable.align, wire_ptr, ptable.base_nbytes)
    raw = torch._C._cuda_getCurrentRawStream(layout.device.index) if cuda else 0
    stream = None  # the torch stream object, fetched only when a table is built or moves streams
    state = plan.by_word.get((word, vec))
    if state is None:
        stream = torch.cuda.current_stream(layout.device) if cuda else None
        state = _WordState(tables, plan, word, vec, stream)
        plan.by_word[(word, vec)] = state
    if cuda and (raw != state.table_entry.raw or raw != state.ids_entry.raw):
        stream = stream or torch.cuda.current_stream(layout.device)
        tables._use(state.table_entry, stream)
        tables._use(state.ids_entry, stream)
    grid = (n, len(plan.layers) * layout.num_kv, 1)  # a compiled kernel's launcher reads all three
    args = (tables.pool_words(word, state.dtype), buf.view(state.dtype), state.table, state.ids, n)
    spec = (to_wire, wire_ptr % 16 == 0)
    kernel = state.kernels.get(spec)
    if kernel is not None:
        try:
            kernel[grid](*args, *state.const_values, to_wire, stream=raw)
            return buf
        except (TypeError, IndexError, AttributeError):  # a Triton whose launcher differs: bind as usual
            state.direct = False
            state.kernels.clear()
    compiled = copy_tiles_kernel[grid](*args, **state.consts, TO_WIRE=to_wire, num_warps=4)
    if cuda and state.direct and compiled is not None and hasattr(compiled, "packed_metadata"):
        state.kernels[spec] = compiled
    return buf
