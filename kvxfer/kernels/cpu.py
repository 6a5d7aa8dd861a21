"""CPU pack/unpack: a multi-threaded C++ tile gather/scatter, and a torch path.

Measured with ``kvxfer bench pack`` (numbers in docs/benchmarks.md): the C++
path (``native``) reaches memcpy speed on every model shape, while torch's
per-plane ``index_select``/``index_copy_`` pays a second pass and Python
overhead per plane; so ``native`` is the default and ``torch`` remains for
machines where the extension is not built.
"""
from __future__ import annotations

import os

from ..runs import TileCopy

# Below this many bytes one thread beats spawning more (thread start ~50 us).
_MIN_BYTES_PER_THREAD = 1 << 20
# Above this, tiles are written with non-temporal stores (see csrc/copy.cpp): the
# copy no longer fits the caches, and streaming skips reading the destination.
STREAM_BYTES = 32 << 20
_TILES_PER_THREAD = 64  # contiguous_copy(streaming=True): tiles per thread


def num_threads() -> int:
    """Threads for the C++ copy: the CPUs this process may use, capped at 16."""
    return max(1, min(16, len(os.sched_getaffinity(0))))


def _threads_for(nbytes: int, threads: int | None) -> int:
    threads = num_threads() if threads is None else threads
    return max(1, min(threads, nbytes // _MIN_BYTES_PER_THREAD))


def native_copy(job: TileCopy, wire, *, to_wire: bool, threads: int | None = None,
                streaming: bool | None = None) -> None:
    """Copy through ``kvxfer._C.copy_tiles``; returns when every byte is in place."""
    from .._native import load

    if job.nbytes == 0:
        return
    load().copy_tiles(job.plane_addrs, job.block_strides, job.outer_strides, job.ids,
                      job.outer_sizes, job.row_bytes, job.tile_bytes, wire.data_ptr(), to_wire,
                      _threads_for(job.nbytes, threads),
                      job.nbytes >= STREAM_BYTES if streaming is None else streaming)


def contiguous_copy(dst_ptr: int, src_ptr: int, nbytes: int, *, threads: int = 1,
                    streaming: bool = False):
    """A prepared native copy of ``nbytes`` contiguous bytes ``src_ptr -> dst_ptr`` (host
    memory the caller owns); returns a callable that does it, returning when every byte
    is in place. The arguments are checked once, here, so a call costs only the copy.

    ``streaming=False``: glibc ``memcpy`` on ``threads`` threads, each a contiguous
    ``1/threads`` of the bytes (glibc picks its store kind per call). ``streaming=True``:
    the C++ tile copy of :func:`native_copy` over ``threads * 64`` consecutive tiles with
    non-temporal stores, the store kind the pack kernels use from :data:`STREAM_BYTES`;
    the bytes past the last whole tile go through memcpy.
    """
    import numpy as np

    from .._native import load

    for name, value in (("dst_ptr", dst_ptr), ("src_ptr", src_ptr), ("nbytes", nbytes), ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if nbytes <= 0 or dst_ptr <= 0 or src_ptr <= 0:
        raise ValueError("nbytes and both addresses must be positive")
    if threads < 1:
        raise ValueError("threads must be >= 1")
    c = load()
    if not streaming:
        return lambda: c.memcpy_parallel(dst_ptr, src_ptr, nbytes, threads)
    num_tiles = threads * _TILES_PER_THREAD
    tile = nbytes // num_tiles // 64 * 64
    if tile == 0:  # too small to split: one tile
        num_tiles, tile = 1, nbytes
    body = num_tiles * tile
    addr = np.array([src_ptr], dtype=np.int64)
    stride = np.array([tile], dtype=np.int64)
    outer = np.zeros(3, dtype=np.int64)
    ids = np.arange(num_tiles, dtype=np.int64)  # consecutive whole tiles: one run per thread

    def copy() -> None:
        c.copy_tiles(addr, stride, outer, ids, (1, 1, 1), tile, tile, dst_ptr, True, threads, True)
        if body < nbytes:
            c.memcpy_parallel(dst_ptr + body, src_ptr + body, nbytes - body, 1)

    return copy


def torch_copy(layout, job: TileCopy, wire, *, to_wire: bool) -> None:
    """Per-plane ``index_select`` (pack) / ``index_copy_`` (unpack) on byte-typed views."""
    import torch

    if job.nbytes == 0:
        return
    from .common import INT_DTYPE_NAMES

    int_dtype = getattr(torch, INT_DTYPE_NAMES[layout.itemsize])
    h0 = job.heads[0] - layout.head_range[0]
    h1 = job.heads[1] - layout.head_range[0]
    n = job.ids.size
    wire = wire.view(int_dtype).view(len(job.layers), layout.num_kv, n, layout.block_size, h1 - h0,
                                     layout.head_dim)
    ids = torch.from_numpy(job.ids).to(layout.device)
    for j, layer in enumerate(job.layers):
        for kv in range(layout.num_kv):
            view = layout.kv_view(layer, kv).view(int_dtype)[:, :, h0:h1]
            if to_wire:
                torch.index_select(view, 0, ids, out=wire[j, kv])
            else:
                view.index_copy_(0, ids, wire[j, kv])
