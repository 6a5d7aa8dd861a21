"""CPU pack/unpack: a multi-threaded C++ tile gather/scatter, and a torch path.

Measured with ``kvxfer bench pack`` (numbers in docs/benchmarks.md): the C++
path (``native``) reaches memcpy speed on every model shape, while torch's
per-plane ``index_select``/``index_copy_`` pays a second pass and Python
overhead per plane; so ``native`` is the default and ``torch`` remains for
machines where the extension is not built.
"""
from __future__ import annotations

import os

from ..runs import CopyPlan

# Below this many bytes one thread beats spawning more (thread start ~50 us).
_MIN_BYTES_PER_THREAD = 1 << 20
# Above this, tiles are written with non-temporal stores (see csrc/copy.cpp): the
# copy no longer fits the caches, and streaming skips reading the destination.
STREAM_BYTES = 32 << 20


def num_threads() -> int:
    """Threads for the C++ copy: the CPUs this process may use, capped at 16."""
    return max(1, min(16, len(os.sched_getaffinity(0))))


def _threads_for(nbytes: int, threads: int | None) -> int:
    threads = num_threads() if threads is None else threads
    return max(1, min(threads, nbytes // _MIN_BYTES_PER_THREAD))


def native_copy(plan: CopyPlan, wire, *, to_wire: bool, threads: int | None = None,
                streaming: bool | None = None) -> None:
    """Copy through ``kvxfer._C.copy_tiles``; returns when every byte is in place."""
    from .._native import load

    if plan.nbytes == 0:
        return
    load().copy_tiles(plan.plane_addrs, plan.block_strides, plan.outer_strides, plan.ids,
                      plan.outer_sizes, plan.row_bytes, plan.tile_bytes, wire.data_ptr(), to_wire,
                      _threads_for(plan.nbytes, threads),
                      plan.nbytes >= STREAM_BYTES if streaming is None else streaming)


def torch_copy(layout, plan: CopyPlan, wire, *, to_wire: bool) -> None:
    """Per-plane ``index_select`` (pack) / ``index_copy_`` (unpack) on byte-typed views."""
    import torch

    if plan.nbytes == 0:
        return
    from .common import INT_DTYPE_NAMES

    int_dtype = getattr(torch, INT_DTYPE_NAMES[layout.itemsize])
    h0 = plan.heads[0] - layout.head_range[0]
    h1 = plan.heads[1] - layout.head_range[0]
    n = plan.ids.size
    wire = wire.view(int_dtype).view(len(plan.layers), layout.num_kv, n, layout.block_size, h1 - h0,
                                     layout.head_dim)
    ids = torch.from_numpy(plan.ids).to(layout.device)
    for j, layer in enumerate(plan.layers):
        for kv in range(layout.num_kv):
            view = layout.kv_view(layer, kv).view(int_dtype)[:, :, h0:h1]
            if to_wire:
                torch.index_select(view, 0, ids, out=wire[j, kv])
            else:
                view.index_copy_(0, ids, wire[j, kv])
