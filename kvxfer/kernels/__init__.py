"""``pack`` / ``unpack``: paged KV blocks <-> the canonical wire format.

Wire format (``docs/wire-format.md``): uint8 bytes of a contiguous
``[layers, kv, n, B, heads, D]`` array of the layout dtype, where ``layers`` are
the selected layers in the order given, ``kv`` is K then V (one latent for MLA),
``n`` the block ids in the order given and ``heads`` the selected global head
range. Layer slot ``j`` is one contiguous range (layer-wise streaming).

Backends: ``"triton"`` (default for CUDA tensors; also CPU tensors under
``TRITON_INTERPRET=1``), ``"native"`` (default for CPU: multi-threaded C++),
``"torch"`` (CPU/GPU torch indexing) and ``"reference"``.

Also public, for tools that measure against the native copy (``kvxfer bench``):
:func:`num_threads` (threads of the C++ copy), :data:`STREAM_BYTES` (from this size
a C++ copy uses non-temporal stores) and :func:`contiguous_copy` (a prepared
native copy of one contiguous range on a given number of threads).
"""
from __future__ import annotations

from . import reference
from .common import check_layout, device_guard, prepare_pack, prepare_unpack
from .cpu import STREAM_BYTES, contiguous_copy, num_threads

__all__ = ["pack", "unpack", "copy_blocks", "BACKENDS", "num_threads", "STREAM_BYTES", "contiguous_copy"]

BACKENDS = ("triton", "native", "torch", "reference")


def _pick(layout, backend):
    if backend is None:
        return "triton" if layout.device.type == "cuda" else "native"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "native" and layout.device.type != "cpu":
        raise ValueError(f"the native backend copies host memory; the pool is on {layout.device}")
    if backend == "triton" and layout.device.type != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    return backend


def _run(layout, job, wire, to_wire: bool, backend: str) -> None:
    """``native`` or ``torch`` (triton goes through :func:`_triton`)."""
    if backend == "native":
        from .cpu import native_copy

        native_copy(job, wire, to_wire=to_wire)
    else:
        from .cpu import torch_copy

        with device_guard(layout.device):
            torch_copy(layout, job, wire, to_wire=to_wire)


def pack(layout, block_ids, *, layers=None, heads=None, out=None, backend=None):
    """Gather blocks into the wire format.

    ``block_ids``: int, sequence, numpy or integer tensor ``[n]`` (any order,
    repeats allowed); ``layers``: None (all) or distinct layer indices, in wire
    order; ``heads``: None (this rank's heads) or a global ``(start, stop)``
    inside :attr:`KVLayout.head_range`; ``out``: optional contiguous uint8
    tensor on the pool's device with at least ``layout.wire_nbytes(n, layers,
    heads)`` bytes. Returns uint8 ``[wire_nbytes]`` (a view of ``out`` if given).

    Completion: CPU backends return with the bytes in place; on CUDA the copy
    is queued on the current stream of the pool's device (stream-ordered, like
    any torch op), whichever device is current in the calling thread.
    """
    check_layout(layout)
    chosen = _pick(layout, backend)
    if chosen == "reference":
        return reference.pack(layout, block_ids, layers=layers, heads=heads, out=out)
    if chosen == "triton":
        return _triton(layout, block_ids, layers, heads, out, True)
    job, buf = prepare_pack(layout, block_ids, layers, heads, out)
    _run(layout, job, buf, True, chosen)
    return buf


def unpack(layout, buf, block_ids, *, layers=None, heads=None, backend=None) -> None:
    """Scatter wire bytes ``buf`` (uint8, contiguous, on the pool's device, at
    least ``wire_nbytes`` long; the first ``wire_nbytes`` are read) into the
    blocks ``block_ids`` (no repeats), for the same ``layers``/``heads`` the
    sender packed. Completion as for :func:`pack`."""
    check_layout(layout)
    chosen = _pick(layout, backend)
    if chosen == "reference":
        return reference.unpack(layout, buf, block_ids, layers=layers, heads=heads)
    if chosen == "triton":
        _triton(layout, block_ids, layers, heads, buf, False)
        return None
    job, wire = prepare_unpack(layout, buf, block_ids, layers, heads)
    _run(layout, job, wire, False, chosen)
    return None


def _triton(layout, block_ids, layers, heads, buf, to_wire: bool):
    """The Triton path: a cached plan per call, launched under the pool's device
    (:func:`kvxfer.kernels.triton_pack.run`, imported on first use)."""
    run = _TRITON_RUN[0]
    if run is None:
        from .triton_pack import run

        _TRITON_RUN[0] = run
    return run(layout, block_ids, layers, heads, buf, to_wire=to_wire)


_TRITON_RUN: list = [None]


def copy_blocks(src, src_ids, dst, dst_ids, *, layers=None, heads=None, backend=None) -> None:
    """Copy blocks of pool ``src`` into blocks of pool ``dst`` directly, with no wire
    buffer between them: block ``src_ids[i]`` lands in ``dst_ids[i]``, for every layer
    of ``layers`` and every kv head of ``heads``.

    ``src``, ``dst``: :class:`~kvxfer.KVLayout` of one model (equal fingerprints), any
    engine layouts and TP splits; ``src_ids`` ``[n]`` any order, repeats allowed;
    ``dst_ids`` ``[n]`` distinct; ``layers``: None (all) or distinct layer indices;
    ``heads``: a global ``(start, stop)`` held by both, None for the overlap of the two
    head ranges (:class:`~kvxfer.errors.LayoutMismatch` if they share none).

    Backends: ``"triton"`` (the default for CUDA pools: one launch, both pools on one
    device -- a peer's pool mapped into this process is on this process's device; CPU
    pools under ``TRITON_INTERPRET=1``); ``"native"`` (the default for CPU pools) and
    ``"torch"`` pack into a temporary wire buffer and unpack it; ``"reference"`` does
    the same with the pure-torch reference. The bytes that land are identical on every
    backend. Completion as for :func:`pack`: on CUDA queued on the current stream of
    the pools' device.
    """
    check_layout(src)
    check_layout(dst)
    src.check_compatible(dst)
    if heads is None:
        heads = src.head_overlap(dst)
        if heads is None:
            from ..errors import LayoutMismatch

            raise LayoutMismatch(f"no kv heads in common: {src.head_range} and {dst.head_range}")
    if src.device != dst.device:
        raise ValueError(f"copy_blocks needs both pools on one device, got {src.device} and {dst.device}")
    chosen = _pick(src, backend)
    if chosen == "triton":
        from .tables import PoolTables
        from .triton_copy import run

        src_plan = PoolTables.of(src).plan(src_ids, layers, heads, unique=False)
        dst_plan = PoolTables.of(dst).plan(dst_ids, layers, heads, unique=True)
        _same_count(src_plan.ids.size, dst_plan.ids.size)
        with device_guard(src.device):
            run(src, src_plan, dst, dst_plan)
        return None
    from .common import resolve

    _same_count(resolve(src, src_ids, layers, heads, unique=False)[0].size,
                resolve(dst, dst_ids, layers, heads, unique=True)[0].size)
    if chosen == "reference":
        return reference.copy_blocks(src, src_ids, dst, dst_ids, layers=layers, heads=heads)
    buf = pack(src, src_ids, layers=layers, heads=heads, backend=chosen)
    unpack(dst, buf, dst_ids, layers=layers, heads=heads, backend=chosen)
    return None


def _same_count(num_src: int, num_dst: int) -> None:
    if num_src != num_dst:
        raise ValueError(f"src_ids has {num_src} blocks, dst_ids {num_dst}")
