"""Where device allocations begin and end, as the CUDA driver reports them.

PyTorch's caching allocator puts per-layer KV tensors back to back, often in
separate ``cudaMalloc`` allocations that merely touch; with
``expandable_segments`` one tensor can even span several physical allocations
(``cuMemCreate`` chunks mapped into one reserved range). UCX and the
registration probe accept a range only inside one allocation, so
:func:`split_regions` cuts the pool's spans where the driver says an
allocation ends:

* **regions** (addressing): storage hulls, merged where they overlap or touch
  inside one allocation, never merged across an allocation boundary. A storage
  never straddles two regions (each plane lies inside one region).
* **parts** (registration): each region cut at every allocation boundary inside
  it; a region has more than one part only when a storage spans several
  physical allocations (expandable segments).

The driver is reached through ``ctypes`` on ``libcuda.so.1``
(``cuPointerGetAttribute`` with ``RANGE_START_ADDR`` / ``RANGE_SIZE``, the
attributes ``cuMemGetAddressRange`` reads, usable from any thread), loaded on
first use; host pools never load it.
"""
from __future__ import annotations

import ctypes
import threading

_ATTR_RANGE_START = 11  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
_ATTR_RANGE_SIZE = 12  # CU_POINTER_ATTRIBUTE_RANGE_SIZE
_lock = threading.Lock()
_driver: list = []  # [ctypes lib or None] once loaded


def _load():
    with _lock:
        if not _driver:
            lib = None
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuInit.argtypes = [ctypes.c_uint]
                lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
                if lib.cuInit(0) != 0:
                    lib = None
            except (OSError, AttributeError):
                lib = None
            _driver.append(lib)
        return _driver[0]


def driver_allocation_range(addr: int) -> tuple | None:
    """``(start, size)`` of the CUDA allocation holding ``addr``; None if the driver is
    missing or does not know the address."""
    lib = _load()
    if lib is None:
        return None
    start, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if lib.cuPointerGetAttribute(ctypes.byref(start), _ATTR_RANGE_START, addr) != 0:
        return None
    if lib.cuPointerGetAttribute(ctypes.byref(size), _ATTR_RANGE_SIZE, addr) != 0:
        return None
    return int(start.value), int(size.value)


def oracle_for(device):
    """The allocation oracle for a pool on ``device`` (None for host memory: no splitting)."""
    return driver_allocation_range if device.type == "cuda" else None


def split_regions(hulls, allocation_range=None) -> tuple:
    """Sorted, disjoint ``((addr, nbytes), ...)`` regions over storage ``hulls`` (``(lo, hi)``).

    ``allocation_range(addr) -> (start, size) | None`` is the boundary oracle;
    None merges every overlapping or touching pair (host memory).
    """
    merged: list = []
    for lo, hi in sorted(hulls):
        if merged and (lo < merged[-1][1] or (lo == merged[-1][1] and not _starts_at(allocation_range, lo))):
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi - lo) for lo, hi in merged)


def split_parts(regions, allocation_range=None) -> tuple:
    """Per region, its parts ``((addr, nbytes), ...)``: the region cut at every allocation
    boundary inside it (one part without an oracle, or where the driver does not know)."""
    out = []
    for addr, nbytes in regions:
        end, parts, at = addr + nbytes, [], addr
        while at < end:
            rng = allocation_range(at) if allocation_range is not None else None
            stop = end if rng is None or rng[0] + rng[1] <= at else min(end, rng[0] + rng[1])
            parts.append((at, stop - at))
            at = stop
        out.append(tuple(parts))
    return tuple(out)


def _starts_at(allocation_range, addr: int) -> bool:
    """True when an allocation begins exactly at ``addr`` (a boundary the hulls touch at)."""
    if allocation_range is None:
        return False
    rng = allocation_range(addr)
    return rng is not None and rng[0] == addr
