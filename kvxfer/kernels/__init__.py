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

__all__ = ["pack", "unpack", "BACKENDS", "num_threads", "STREAM_BYTES", "contiguous_copy"]

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
    (:func:`kvxfer.kernels.triton_pack.run`)."""
    from .triton_pack import run

    return run(layout, block_ids, layers, heads, buf, to_wire=to_wire)
