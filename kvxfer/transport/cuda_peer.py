"""Same-node GPU peers: the peer's registered pool mapped here, a whole piece in one launch.

Where two agents' pools are CUDA memory on one node (one GPU, or GPUs with peer
access), posting one UCX ``cuda_ipc`` put per contiguous run costs ~7 us a run: a
2,048-token Llama-3-8B request is 8,192 runs. Instead P maps D's registered pool into
its own address space once per peer and moves a whole piece -- every layer, any
layout pair, a head range -- with one launch of the pool-to-pool kernel
(:func:`kvxfer.kernels.copy_blocks`), queued on P's kvxfer stream behind the
producer's event. ``Peer.device_transport`` then reads ``"cuda_peer"``.

What crosses the control channel, inside INFO (sent only after the peer
authenticated, like an rkey) -- :func:`export_pool`::

    {"node": boot id, "device": GPU uuid,
     "regions": [[ipc handle (hex), offset in its allocation, nbytes], ...]}   # one per region

One IPC handle names a whole device allocation; a region is a range inside one.
:func:`open_peer_pool` opens each allocation once per process (:class:`HandleCache`,
reference-counted: CUDA opens a handle once per context, and two agents of one
process may map the same peer), checks that every advertised region lies inside the
allocation the driver actually mapped, and builds a :class:`~kvxfer.KVLayout` over the
mapped memory from the peer's validated :class:`~kvxfer.transport.descriptors.Geometry`
(every plane inside its region, block ids checked against its pool): a peer can only
be reached in the ranges it advertised and owns. :meth:`PeerPool.close` releases the
mapping (on disconnect and when the agent closes, its registrations going).

Anything that keeps a pool from being exported or mapped -- host memory, regions that
span several allocations (``expandable_segments``), another node, GPUs without peer
access, a driver error -- leaves that peer on UCX. :class:`CudaIpc` is the driver
(``libcuda`` through ``ctypes``, like :mod:`kvxfer.cuda_ranges`); tests stand in for it
with host memory of one process.
"""
from __future__ import annotations

import ctypes
import logging
import threading

from ..errors import KVXferError

log = logging.getLogger("kvxfer")

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class PeerMapError(KVXferError):
    """A peer's pool cannot be mapped here (the transfer falls back to UCX)."""


def node_id() -> str:
    """This host's boot id: CUDA IPC handles only open on the node that made them."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class CudaIpc:
    """CUDA IPC through the driver API (``libcuda.so.1``); every call raises
    :class:`PeerMapError` on a driver error. Each call first makes the primary context of
    device ``index`` current in the calling thread (the one PyTorch's runtime uses)."""

    def __init__(self) -> None:
        from ..cuda_ranges import _load

        lib = _load()
        if lib is None:
            raise PeerMapError("the CUDA driver is not available")
        u64, ptr, c_int = ctypes.c_uint64, ctypes.POINTER, ctypes.c_int
        self._open = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        self._range = getattr(lib, "cuMemGetAddressRange_v2", None) or lib.cuMemGetAddressRange
        lib.cuIpcGetMemHandle.argtypes = [ptr(_Handle), u64]
        self._open.argtypes = [ptr(u64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [u64]
        self._range.argtypes = [ptr(u64), ptr(ctypes.c_size_t), u64]
        lib.cuDeviceGet.argtypes = [ptr(c_int), c_int]
        lib.cuDeviceGetUuid.argtypes = [ctypes.c_char_p, c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ptr(ctypes.c_void_p), c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self._contexts: dict = {}  # device index -> (CUdevice, primary CUcontext)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise PeerMapError(f"{what} failed (CUresult {rc})")

    def _bind(self, index: int) -> int:
        """Make device ``index``'s primary context current here; its CUdevice."""
        got = self._contexts.get(index)
        if got is None:
            dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
            self._check(self._lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
            self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
            got = self._contexts[index] = (dev.value, ctx.value)
        self._check(self._lib.cuCtxSetCurrent(got[1]), "cuCtxSetCurrent")
        return got[0]

    def _allocation(self, addr: int) -> tuple:
        start, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        self._check(self._range(ctypes.byref(start), ctypes.byref(size), addr), "cuMemGetAddressRange")
        return int(start.value), int(size.value)

    def export(self, addr: int, index: int) -> tuple:
        """``(handle bytes, allocation start, allocation size)`` of the allocation holding ``addr``."""
        self._bind(index)
        start, size = self._allocation(addr)
        handle = _Handle()
        self._check(self._lib.cuIpcGetMemHandle(ctypes.byref(handle), start), "cuIpcGetMemHandle")
        return bytes(handle.reserved), start, size

    def open(self, handle: bytes, index: int) -> tuple:
        """Map another process's allocation for device ``index``: ``(address here, mapped size)``."""
        self._bind(index)
        raw = _Handle()
        raw.reserved = handle
        dptr = ctypes.c_uint64(0)
        self._check(self._open(ctypes.byref(dptr), raw, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        try:
            start, size = self._allocation(dptr.value)
            if start != dptr.value:
                raise PeerMapError("the driver mapped an allocation at an unexpected address")
        except PeerMapError:
            self._lib.cuIpcCloseMemHandle(dptr.value)
            raise
        return int(dptr.value), size

    def close(self, addr: int, index: int) -> None:
        self._bind(index)
        self._check(self._lib.cuIpcCloseMemHandle(addr), "cuIpcCloseMemHandle")

    def device_uuid(self, index: int) -> str:
        dev = self._bind(index)
        uuid = ctypes.create_string_buffer(16)
        self._check(self._lib.cuDeviceGetUuid(uuid, dev), "cuDeviceGetUuid")
        return uuid.raw.hex()


class HandleCache:
    """Allocations of other processes mapped into this one: handle -> [address, size,
    references]. One per process (:data:`HANDLES`); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict = {}

    def acquire(self, ipc, handle: bytes, device) -> tuple:
        """``(address, size)`` of ``handle``'s allocation, mapped for ``device`` (a
        ``torch.device``) on first use."""
        with self._lock:
            entry = self._open.get((id(ipc), handle))
            if entry is None:
                addr, size = ipc.open(handle, device.index or 0)
                entry = self._open[(id(ipc), handle)] = [addr, size, 0]
            entry[2] += 1
            return entry[0], entry[1]

    def release(self, ipc, handle: bytes, device) -> None:
        """Drop one reference; the last unmaps the allocation."""
        with self._lock:
            entry = self._open.get((id(ipc), handle))
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] > 0:
                return
            del self._open[(id(ipc), handle)]
        try:
            ipc.close(entry[0], device.index or 0)
        except PeerMapError as exc:
            log.warning("closing a peer's mapped allocation: %s", exc)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


HANDLES = HandleCache()


# ---- export (the pool's owner) -------------------------------------------------------
def export_pool(ipc, layout, region_parts) -> dict:
    """The INFO entry that lets a same-node peer map ``layout``'s registered regions
    (``region_parts``: per region its ``((addr, nbytes), ...)`` parts), or ``{}`` where
    they cannot be exported (a region across several allocations, a driver error)."""
    if ipc is None:
        return {}
    regions = []
    index = layout.device.index or 0
    try:
        for parts in region_parts:
            if len(parts) != 1:
                raise PeerMapError("a region spans several device allocations")
            addr, nbytes = parts[0]
            handle, start, size = ipc.export(addr, index)
            if not (start <= addr and addr + nbytes <= start + size):
                raise PeerMapError("a region is not inside its allocation")
            regions.append([handle.hex(), addr - start, nbytes])
        device = ipc.device_uuid(index)
    except PeerMapError as exc:
        log.info("the KV pool is not offered to same-node peers: %s", exc)
        return {}
    return {"node": node_id(), "device": device, "regions": regions}


def parse_export(entry, geometry) -> dict:
    """A peer's :func:`export_pool` entry, checked against its ``geometry``; ``{}`` when
    it offered none. Raises ValueError if it is malformed."""
    if entry == {}:
        return {}
    if type(entry) is not dict or set(entry) != {"node", "device", "regions"}:
        raise ValueError("peer export")
    if type(entry["node"]) is not str or type(entry["device"]) is not str or type(entry["regions"]) is not list:
        raise ValueError("peer export")
    regions = entry["regions"]
    if geometry is None or len(regions) != len(geometry.region_sizes):
        raise ValueError("peer export regions")
    out = []
    for row, size in zip(regions, geometry.region_sizes):
        if type(row) is not list or len(row) != 3 or type(row[0]) is not str or len(row[0]) != 2 * HANDLE_BYTES:
            raise ValueError("peer export region")
        handle = bytes.fromhex(row[0])
        if type(row[1]) is not int or row[1] < 0 or row[2] != size:
            raise ValueError("peer export region")
        out.append((handle, row[1], row[2]))
    return {"node": entry["node"], "device": entry["device"], "regions": tuple(out)}


# ---- import (the peer that moves the bytes) -----------------------------------------
class PeerPool:
    """A peer's pool mapped into this process: ``layout`` (a :class:`~kvxfer.KVLayout`
    over the mapped memory, on this process's device), released by :meth:`close`."""

    def __init__(self, ipc, cache: HandleCache, device, layout, handles: list) -> None:
        self.layout = layout
        self._ipc, self._cache, self._device = ipc, cache, device
        self._handles = handles
        self._lock = threading.Lock()

    def close(self) -> None:
        """Unmap (idempotent). Call only once nothing launched still reads or writes it."""
        with self._lock:
            handles, self._handles = self._handles, []
            self.layout = None
        for handle in handles:
            self._cache.release(self._ipc, handle, self._device)

    @property
    def closed(self) -> bool:
        return self.layout is None


def open_peer_pool(ipc, offer: dict, geometry, like, cache: HandleCache = HANDLES) -> PeerPool:
    """Map the pool a peer offered (``offer``: :func:`parse_export`'s result, ``geometry``:
    its validated Geometry) into this process for copies with ``like`` (our own layout:
    device, dtype, model). Raises :class:`PeerMapError` (nothing stays mapped)."""
    if not offer:
        raise PeerMapError("the peer offers no mappable pool")
    if offer["node"] != node_id() or not offer["node"]:
        raise PeerMapError("the peer is on another node")
    device = like.device
    taken: list = []
    try:
        bases = []
        for handle, offset, nbytes in offer["regions"]:
            addr, size = cache.acquire(ipc, handle, device)
            taken.append(handle)
            if offset + nbytes > size:
                raise PeerMapError(f"an advertised region ({offset} + {nbytes} B) lies outside its "
                                   f"allocation ({size} B)")
            bases.append(addr + offset)
        layout = mapped_layout(geometry, bases, like)
    except BaseException:
        for handle in taken:
            cache.release(ipc, handle, device)
        raise
    return PeerPool(ipc, cache, device, layout, taken)


def mapped_layout(geometry, bases: list, like):
    """A :class:`~kvxfer.KVLayout` of the peer's pool over its regions mapped at ``bases``
    (one address per region), with ``like``'s dtype and device. Raises
    :class:`PeerMapError` where its byte strides are not whole elements."""
    import torch

    from ..layout import KVLayout

    item = geometry.itemsize
    if item != like.itemsize:
        raise PeerMapError(f"element size {item} B, ours {like.itemsize} B")
    device = like.device
    storages = [torch._C._construct_storage_from_data_pointer(addr, device, nbytes)
                for addr, nbytes in zip(bases, geometry.region_sizes)]
    mla = geometry.num_kv == 1
    shape = ((geometry.num_blocks, geometry.block_size, geometry.head_dim) if mla else
             (geometry.num_blocks, geometry.block_size, geometry.num_heads, geometry.head_dim))
    planes = []
    for region, offset, *strides in geometry.planes:
        if mla:
            strides = [strides[0], strides[1], strides[3]]
        if offset % item or any(s % item for s in strides):
            raise PeerMapError("the peer's pool has strides that are not whole elements")
        try:
            planes.append(torch.empty(0, dtype=like.dtype, device=device).set_(
                storages[region], offset // item, shape, [s // item for s in strides]))
        except RuntimeError as exc:  # outside its storage: Geometry.from_wire should have refused it
            raise PeerMapError(f"a plane of the peer's pool does not fit its region: {exc}") from None
    if mla:
        layout = KVLayout.from_tensors(planes, "N B C", byte_format=like.byte_format)
    else:
        heads, global_heads = geometry.num_heads, like.num_global_heads
        if geometry.head_lo % heads or global_heads % heads:
            raise PeerMapError(f"head range {geometry.head_range} is not a TP rank of {global_heads} heads")
        layout = KVLayout.from_tensors((planes[0::2], planes[1::2]), "N B H D", tp_rank=geometry.head_lo // heads,
                                       tp_size=global_heads // heads, byte_format=like.byte_format)
    if layout.fingerprint() != geometry.fingerprint:
        raise PeerMapError("the mapped pool's fingerprint differs from the advertised one")
    return layout


class PeerLink:
    """One connected peer's same-node path as this agent sees it: ``state`` is ``"off"``
    (not offered, another node, or disabled here), ``"offered"`` (mappable, not mapped
    yet), ``"mapped"``, ``"failed"`` (``error`` says why; the peer stays on UCX) or
    ``"closed"``. Mapped on first use by the agent's send worker, closed once."""

    def __init__(self, offer: dict, ipc, enabled: bool) -> None:
        self.offer = offer
        self._ipc = ipc
        self.state = "offered" if enabled and ipc is not None and offer and offer["node"] == node_id() else "off"
        self.error = ""
        self._pool: PeerPool | None = None
        self._lock = threading.Lock()

    @property
    def usable(self) -> bool:
        """Pieces for this peer take the one-launch copy (until a mapping fails)."""
        return self.state in ("offered", "mapped")

    def pool(self, geometry, like) -> PeerPool | None:
        """The peer's pool mapped here, mapped now if it is not yet; None where it cannot
        be (the link is then ``"failed"``, logged once) or the link is off or closed.
        ``geometry``: the peer's validated Geometry; ``like``: our own layout."""
        with self._lock:
            if self.state == "mapped":
                return self._pool
            if self.state != "offered":
                return None
            try:
                self._pool = open_peer_pool(self._ipc, self.offer, geometry, like)
            except PeerMapError as exc:
                self.state, self.error = "failed", str(exc)
                log.warning("peer copies unavailable, UCX carries the bytes: %s", exc)
                return None
            self.state = "mapped"
            return self._pool

    def close(self) -> None:
        """Unmap (idempotent); only once nothing launched still touches the mapping."""
        with self._lock:
            pool, self._pool = self._pool, None
            if self.state in ("offered", "mapped"):
                self.state = "closed"
        if pool is not None:
            pool.close()
