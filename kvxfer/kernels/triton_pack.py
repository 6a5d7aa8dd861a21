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

import torch as _torch

from ..runs import TileCopy
from .common import check_buffer, device_guard
from .tables import PoolTables

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


class _Launch:
    """What a :class:`~kvxfer.kernels.tables.Plan` launches with, per direction and wire
    alignment (the low 4 bits of the wire address fix the word and vector size): the
    device table and ids entries, the Triton arguments and, once compiled, the kernel's
    runner for this grid with the raw pointers of everything but the wire, so a repeated
    call allocates nothing and converts no tensor."""

    __slots__ = ("table_entry", "ids_entry", "dtype", "consts", "grid", "head", "tail", "runner", "word")

    def __init__(self, tables, plan, word: int, vec: int, to_wire: bool, num_kv: int, stream) -> None:
        import torch

        ptable = tables.plane_table(plan.heads)
        self.word = word
        self.table_entry, table = tables.table_entry(plan.heads, word, plan.layers, stream)
        self.ids_entry = tables.ids_entry(plan.ids, stream)
        self.dtype = getattr(torch, _WORD_DTYPES[word])
        self.consts = _consts(ptable, word, vec)
        pool = tables.pool_words(word, self.dtype)
        self.grid = (plan.ids.size, len(plan.layers) * num_kv, 1)  # a compiled kernel's launcher reads all three
        self.head = (pool,)  # the kernel's arguments before the wire ...
        self.tail = (table, self.ids_entry.tensor, plan.ids.size)  # ... and after it
        self.runner = None  # the compiled kernel's runner, set after the first (bound) launch

    def compiled(self, kernel, to_wire: bool) -> None:
        """Launch ``kernel`` directly from now on, with raw pointers (ints skip the launcher's
        ``data_ptr`` calls and pointer checks; the tensors stay alive in this object)."""
        (pool,), (table, ids, n) = self.head, self.tail
        consts = tuple(self.consts[name] for name in _CONST_NAMES)  # the launcher's order
        self.runner = (kernel[self.grid], (pool.data_ptr(),), (table.data_ptr(), ids.data_ptr(), n, *consts, to_wire))


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
    tables = layout.__dict__.get("_kvx_tables") or PoolTables.of(layout)
    plan = tables.plan(block_ids, layers, heads, unique=not to_wire)
    if not tables.cuda:
        return _run(tables, plan, layout, buf, to_wire, False)
    if _torch.cuda.current_device() == tables.device.index:
        return _run(tables, plan, layout, buf, to_wire, True)
    with device_guard(tables.device):
        return _run(tables, plan, layout, buf, to_wire, True)


def _run(tables, plan, layout, buf, to_wire: bool, cuda: bool):
    torch = _torch
    nbytes = plan.nbytes
    if buf is None:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=tables.device)
    elif (type(buf) is not torch.Tensor or buf.dtype is not torch.uint8 or buf.device != tables.device
          or not buf.is_contiguous() or buf.numel() < nbytes):
        check_buffer(layout, nbytes, buf, "out" if to_wire else "buf")  # raises what is wrong (a subclass passes)
    if buf.dim() != 1 or buf.numel() != nbytes:
        buf = buf.reshape(-1)[:nbytes]
    if plan.ids.size == 0:
        return buf
    wire_ptr = buf.data_ptr()
    key = (to_wire, wire_ptr & 15)
    launch = plan.by_word.get(key)
    stream = None  # the torch stream object, fetched only when a table is built or moves streams
    if launch is None:
        ptable = tables.plane_table(plan.heads)
        word, vec = _word(ptable.align, wire_ptr, ptable.base_nbytes)
        stream = torch.cuda.current_stream(tables.device) if cuda else None
        launch = _Launch(tables, plan, word, vec, to_wire, layout.num_kv, stream)
        plan.by_word[key] = launch
    if not cuda:
        copy_tiles_kernel[launch.grid](*launch.head, buf.view(launch.dtype), *launch.tail, **launch.consts,
                                       TO_WIRE=to_wire, num_warps=4)
        return buf
    raw = torch._C._cuda_getCurrentRawStream(tables.device.index)
    if raw != launch.table_entry.raw or raw != launch.ids_entry.raw:
        stream = stream or torch.cuda.current_stream(tables.device)
        tables._use(launch.table_entry, stream)
        tables._use(launch.ids_entry, stream)
    runner = launch.runner
    if runner:
        fn, head, tail = runner
        try:
            fn(*head, wire_ptr, *tail, stream=raw)
            return buf
        except (TypeError, IndexError, AttributeError):  # a Triton whose launcher differs: bind as usual
            launch.runner = False
    compiled = copy_tiles_kernel[launch.grid](*launch.head, buf.view(launch.dtype), *launch.tail, **launch.consts,
                                              TO_WIRE=to_wire, num_warps=4)
    if runner is None and compiled is not None and hasattr(compiled, "packed_metadata"):
        launch.compiled(compiled, to_wire)
    return buf
