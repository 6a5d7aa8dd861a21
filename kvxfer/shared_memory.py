"""Host KV pools that same-host peers write with plain ``memcpy``.

On one host kvxfer's ``vm`` transport copies with ``process_vm_writev``, which
pins and walks the destination page by page on every request. A pool allocated
with :func:`shared_empty` lives in a sealed ``memfd`` instead: when it is
registered, the engine advertises the memfd (to authenticated peers only, like
an rkey), and a peer on the vm path maps it once at connect and then moves bytes
with plain copies on its copy threads (non-temporal stores for batches from 32 MiB). Descriptors are bounds-checked against the
advertised regions as before; a region outside such a pool, or a memfd the peer
cannot open (another user, no ptrace access) stays on ``process_vm_writev``.
``Peer.transport`` stays ``"vm"``; the backend connection's ``shared_regions``
says how many of the peer's regions are mapped.

A peer keeps its mapping until it disconnects, so the memory outlives the tensor
in that peer (the pages are freed when the last mapping goes). Allocation is
eager: the pages are zeroed and populated at once.
"""
from __future__ import annotations

import ctypes
import math
import weakref


def shared_empty(shape, dtype=None):
    """A zeroed CPU tensor of ``shape`` and ``dtype`` (default ``torch.uint8``) on shared memory.

    ``shape``: int or sequence of ints (>= 0 each, at least one element in all).
    The memory is freed when the tensor and every view of it are gone. Raises
    ``TypeError``/``ValueError`` for a bad shape or dtype and
    :class:`~kvxfer.errors.RegistrationError` when the memory cannot be allocated.
    """
    import torch

    from ._native import load

    dtype = torch.uint8 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"shape must be ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"shape must be >= 0, got {shape!r}")
    numel = math.prod(dims)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if numel == 0:
        raise ValueError("shared_empty needs at least one element")
    nbytes = numel * itemsize
    c = load()
    addr = c.shared_alloc(nbytes)
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    # torch.frombuffer keeps buf alive with the storage; at exit the mapping stays (threads may still use it)
    weakref.finalize(buf, c.shared_free, addr).atexit = False
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(dims)
