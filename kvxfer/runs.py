"""Where the bytes of blocks live: tile copies, memory regions, byte runs.

A :class:`TileCopy` turns (layout, block ids, layers, heads) into the numbers
every copy path uses: per wire plane (a selected (layer, kv) pair, in wire
order) the address of its head-range origin, its block stride, and a tile of
``S0 x S1 x S2`` rows of ``row_bytes`` contiguous bytes. Rows are the largest
pieces contiguous both in engine memory and in the wire format (dims are
merged only where every plane allows it), so one kernel launch covers all
planes. Validation happens here, before anything touches memory.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


def check_block_ids(block_ids, num_blocks: int, *, unique: bool):
    """The one validator of block ids (agent calls, pack/unpack, the vLLM connector through
    the agent): integers only, each in ``[0, num_blocks)``, distinct if ``unique``.

    Takes a Python int, a list/tuple/range of Python ints or numpy integers, an integer
    numpy array or scalar, or an integer torch tensor (0-d or 1-d). Returns a tuple of
    Python ints for a sequence or scalar, an int64 numpy ``[n]`` for an array or tensor.
    TypeError: a float, str, bool (also ``numpy.bool_`` and bool/float dtypes) or any
    other type; ValueError: an id out of range (however large: never OverflowError), a
    non-1-d array, duplicates where ``unique``.
    """
    t = type(block_ids)
    if t is list or t is tuple:
        if block_ids and set(map(type, block_ids)) != {int}:  # the common case skips this
            for x in block_ids:
                if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                    raise TypeError(f"block_ids must hold ints, got {type(x).__name__} ({x!r})")
            block_ids = [int(x) for x in block_ids]
        ids = tuple(block_ids)
    elif t is range:
        ids = tuple(block_ids)
    elif isinstance(block_ids, (bool, np.bool_)):
        raise TypeError("block_ids must be ints, got a bool")
    elif isinstance(block_ids, (int, np.integer)):
        ids = (int(block_ids),)
    elif isinstance(block_ids, np.ndarray):
        return _check_array(block_ids, num_blocks, unique)
    elif t.__module__.startswith("torch"):
        import torch

        if not isinstance(block_ids, torch.Tensor):
            raise TypeError(f"block_ids must be ints or an integer tensor, got {t.__name__}")
        if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
            raise TypeError(f"a block_ids tensor must have an integer dtype, got {block_ids.dtype}")
        return _check_array(block_ids.detach().cpu().numpy(), num_blocks, unique)
    else:
        raise TypeError(f"block_ids must be an int, a sequence of ints, an integer array or tensor; "
                        f"got {t.__name__}")
    if ids:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"negative block id {lo}" if lo < 0 else
                             f"block id {hi} out of range [0, {num_blocks})")
        if unique and len(set(ids)) != len(ids):
            raise ValueError("block_ids has duplicates; one block would be written twice")
    return ids


def _check_array(arr: np.ndarray, num_blocks: int, unique: bool) -> np.ndarray:
    if arr.dtype.kind not in "iu":
        raise TypeError(f"a block_ids array must have an integer dtype, got {arr.dtype}")
    if arr.ndim > 1:
        raise ValueError(f"block_ids must be 1-d, got shape {arr.shape}")
    arr = arr.reshape(-1)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())  # Python ints: a uint64 id cannot wrap
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"negative block id {lo}" if lo < 0 else
                             f"block id {hi} out of range [0, {num_blocks})")
        if unique and np.unique(arr).size != arr.size:
            raise ValueError("block_ids has duplicates; one block would be written twice")
    return np.ascontiguousarray(arr, dtype=np.int64)


def normalize_ids(block_ids, num_blocks: int, *, unique: bool) -> np.ndarray:
    """:func:`check_block_ids` as an int64 numpy ``[n]`` (what the copy paths index with)."""
    ids = check_block_ids(block_ids, num_blocks, unique=unique)
    return ids if isinstance(ids, np.ndarray) else np.array(ids, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class TileCopy:
    """Numbers for one pack/unpack (``kvxfer::TileCopy`` of csrc/copy.h);
    wire layout ``[layers][kv][ids][S0][S1][S2][row_bytes]``."""

    ids: np.ndarray  # int64 [n]
    layers: tuple
    heads: tuple  # global (start, stop)
    plane_addrs: np.ndarray  # int64 [P]: address of block 0's tile origin per wire plane
    block_strides: np.ndarray  # int64 [P]
    outer_strides: np.ndarray  # int64 [P, 3]
    outer_sizes: tuple  # (S0, S1, S2)
    row_bytes: int
    tile_bytes: int  # = S0 * S1 * S2 * row_bytes = B * heads * D * itemsize
    nbytes: int  # = P * n * tile_bytes

    @property
    def num_planes(self) -> int:
        return len(self.plane_addrs)


def tile_copy(layout, block_ids, *, layers=None, heads=None, unique: bool = False) -> TileCopy:
    ids = normalize_ids(block_ids, layout.num_blocks, unique=unique)
    layers = layout.resolve_layers(layers)
    heads = layout.resolve_heads(heads)
    h0, num_h = heads[0] - layout.head_range[0], heads[1] - heads[0]
    item = layout.itemsize
    planes = [layout.planes[l][kv] for l in layers for kv in range(layout.num_kv)]
    ptrs = [t.data_ptr() for t in layout.tensors]
    addrs = np.array([ptrs[p.tensor_index] + p.offset + h0 * p.strides[2] for p in planes], dtype=np.int64)
    block_strides = np.array([p.strides[0] for p in planes], dtype=np.int64)
    # wire tile dims, outer to inner: token (B), head, dim; merge from the inside
    dims = [(layout.block_size, [p.strides[1] for p in planes]), (num_h, [p.strides[2] for p in planes])]
    if all(p.strides[3] == item for p in planes):
        row = layout.head_dim * item
    else:
        row = item
        dims.append((layout.head_dim, [p.strides[3] for p in planes]))
    while dims and (dims[-1][0] == 1 or all(s == row for s in dims[-1][1])):
        row *= dims.pop()[0]
    dims = [d for d in dims if d[0] != 1]
    dims = [(1, [0] * len(planes))] * (3 - len(dims)) + dims
    outer = np.array([d[1] for d in dims], dtype=np.int64).T.reshape(len(planes), 3)
    tile = layout.block_size * num_h * layout.head_dim * item
    return TileCopy(ids, layers, heads, addrs, block_strides, np.ascontiguousarray(outer),
                    tuple(d[0] for d in dims), row, tile, len(planes) * ids.size * tile)


def storage_hulls(layout) -> list:
    """``[(lo, hi), ...]``: per storage, the hull of the bytes the layout's tensors touch."""
    from ._dims import tensor_span

    hulls = {}
    for t in layout.tensors:
        lo, nbytes = tensor_span(t)
        hi = lo + nbytes
        key = t.untyped_storage().data_ptr()
        a, b = hulls.get(key, (lo, hi))
        hulls[key] = (min(a, lo), max(b, hi))
    return list(hulls.values())


def regions(layout, allocation_range=None) -> tuple:
    """``((address, nbytes), ...)`` sorted, non-overlapping: one hull per storage, overlaps
    merged, touching hulls merged unless a device allocation boundary separates them
    (see :mod:`kvxfer.cuda_ranges`; ``allocation_range`` defaults to the driver's for CUDA)."""
    from .cuda_ranges import oracle_for, split_regions

    oracle = allocation_range if allocation_range is not None else oracle_for(layout.device)
    return split_regions(storage_hulls(layout), oracle)


def block_runs(layout, block_ids, *, layers=None, heads=None) -> np.ndarray:
    """int64 ``[num_runs, 4]``: region, offset in region, wire offset, length (coalesced).

    Block -> wire runs (one side's bytes in a contiguous buffer: the store's objects);
    block -> block runs between two pools are
    :func:`kvxfer.transport.descriptors._tile_runs`'s, which pair two layouts' offsets."""
    job = tile_copy(layout, block_ids, layers=layers, heads=heads)
    if job.nbytes == 0:
        return np.zeros((0, 4), dtype=np.int64)
    spans = regions(layout)
    starts = [lo for lo, _ in spans]
    region = np.array([bisect.bisect_right(starts, int(a)) - 1 for a in job.plane_addrs], dtype=np.int64)
    base = job.plane_addrs - np.array([starts[r] for r in region], dtype=np.int64)
    s0, s1, s2 = (np.arange(s, dtype=np.int64) for s in job.outer_sizes)
    o = job.outer_strides
    inner = (s0[None, :, None, None] * o[:, None, None, None, 0] + s1[None, None, :, None] * o[:, None, None, None, 1]
             + s2[None, None, None, :] * o[:, None, None, None, 2])  # [P, S0, S1, S2]
    offs = (base[:, None] + job.ids[None, :] * job.block_strides[:, None])[:, :, None] + inner.reshape(len(base), 1, -1)
    offs = offs.reshape(-1)
    regs = np.broadcast_to(region[:, None], (len(base), offs.size // len(base))).reshape(-1)
    row = job.row_bytes
    brk = np.ones(offs.size, dtype=bool)
    brk[1:] = (regs[1:] != regs[:-1]) | (offs[1:] != offs[:-1] + row)
    first = np.flatnonzero(brk)
    lengths = np.diff(np.append(first, offs.size)) * row
    return np.stack([regs[first], offs[first], first * row, lengths], axis=1).astype(np.int64)

