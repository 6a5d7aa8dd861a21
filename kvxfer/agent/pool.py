"""The registered pool: regions in parts, the two staging rings, the INFO we advertise.

:func:`register_pool` registers each region of a layout (in parts that stay inside
one device allocation, see below) and the two staging buffers, once; what it
registered is released again if any step fails. :func:`local_info` is this agent's
INFO; :func:`parse_info` checks a peer's against our own geometry.

Regions registered in parts: a region (the addressing unit of
:class:`~kvxfer.transport.descriptors.Geometry`, a staging buffer) is registered as
one or more *region parts*, each inside one device allocation
(:meth:`KVLayout.region_parts`; with PyTorch's ``expandable_segments`` one tensor
spans several physical chunks, and a backend registration may not cross them).
Descriptors name a region by its first part's id with offsets from the region's
start; :func:`split_descs` rewrites the rows that cross a part boundary on either
side into per-part rows just before they are posted. Parts map: ``{first part id:
((part id, offset in region, nbytes), ...)}``, only for regions of more than one
part (empty on CPU and for ``cudaMalloc`` pools, where nothing is rewritten).

:class:`StagingRing`: a first-fit allocator over one registered staging buffer. D
grants pack chunks a slice of its ring; P packs into its own. Requests that do not
fit wait in FIFO order and are granted as slices are freed, so a burst of large
transfers queues instead of failing. Offsets are 256-byte aligned.
"""
from __future__ import annotations

import bisect
import logging
import threading

import numpy as np

from ..cuda_ranges import oracle_for, split_parts
from ..errors import KVXferError, ProtocolError, RegistrationError
from ..kernels.common import device_guard
from ..transport.cuda_peer import CudaIpc, PeerMapError, export_pool, parse_export
from ..transport.descriptors import Geometry
from .state import AgentState, Pool

log = logging.getLogger("kvxfer")


def register_pool(state: AgentState, layout, device=None) -> Pool:
    """Register ``layout``'s pool and two ``staging_bytes`` buffers on its device; raises
    :class:`RegistrationError` (nothing stays registered) on failure. ``device``: the
    agent's :class:`~kvxfer.kernels.device.Device`, whose ``ipc`` (or, for a CUDA pool,
    the driver's) exports the pool to same-node peers unless ``config.peer_copy`` is off."""
    import torch

    backend, nbytes = state.backend, state.staging_bytes
    registered: list = []
    kind, index = layout.device.type, layout.device.index or 0

    def register(addr, length):
        rid = backend.register(addr, length, device=kind, device_id=index)
        registered.append(rid)
        return rid

    try:
        region_parts = layout.region_parts()
        region_ids, parts_map, _ = register_parts(register, region_parts)
        with device_guard(layout.device):  # agent threads must not default to device 0
            stage_in_t = torch.empty(nbytes, dtype=torch.uint8, device=layout.device)
            stage_out_t = torch.empty(nbytes, dtype=torch.uint8, device=layout.device)
        stage = [(t.data_ptr(), t.numel()) for t in (stage_in_t, stage_out_t)]
        stage_ids, stage_parts, _ = register_parts(register, split_parts(stage, oracle_for(layout.device)))
    except Exception as exc:
        for rid in registered:
            backend.deregister(rid)
        if isinstance(exc, KVXferError):
            raise
        raise RegistrationError(f"cannot register the KV pool: {exc}") from exc
    ipc = peer_ipc(device, layout) if state.config.peer_copy else None
    return Pool(layout=layout, geometry=Geometry.from_layout(layout), region_ids=region_ids,
                registered=registered, parts={**parts_map, **stage_parts}, stage_in_t=stage_in_t,
                stage_out_t=stage_out_t, stage_in_region=stage_ids[0], stage_out_region=stage_ids[1],
                stage_in=StagingRing(nbytes), stage_out=StagingRing(nbytes), ipc=ipc,
                peer_offer=export_pool(ipc, layout, region_parts))


def peer_ipc(device, layout):
    """What maps same-node peers' pools for this agent: ``device.ipc`` where the device
    brings one (tests), the CUDA driver's for a CUDA pool, else None (no peer copies)."""
    ipc = getattr(device, "ipc", None)
    if ipc is None and layout.device.type == "cuda":
        try:
            ipc = CudaIpc()
        except PeerMapError as exc:
            log.info("no same-node peer copies: %s", exc)
    return ipc


def local_info(state: AgentState) -> dict:
    """This agent's INFO (sent only after the peer authenticated)."""
    layout, pool = {}, state.pool
    if pool is not None:
        layout = {"geometry": pool.geometry.to_wire(), "regions": pool.region_ids,
                  "stage_region": pool.stage_in_region, "parts": parts_to_wire(
                      {r: p for r, p in pool.parts.items() if r != pool.stage_out_region}),
                  "peer": pool.peer_offer}
    return {"name": state.name, "agent_id": state.agent_id, "layout": layout,
            "backend": state.backend.metadata(), "staging": state.staging_bytes}


def parse_info(state: AgentState, fields: dict) -> dict:
    """A peer's INFO as ``Peer`` fields; ProtocolError if malformed, LayoutMismatch if
    its geometry cannot exchange blocks with ours."""
    layout = fields["layout"]
    out = {"geometry": None, "regions": [], "stage_region": 0, "staging": fields["staging"], "parts": {},
           "peer": {}}
    if layout:
        try:
            geometry = Geometry.from_wire(layout["geometry"])
            regions, stage = layout["regions"], layout["stage_region"]
            ok = (set(layout) == {"geometry", "regions", "stage_region", "parts", "peer"} and type(stage) is int
                  and type(regions) is list and all(type(r) is int for r in regions)
                  and len(regions) == len(geometry.region_sizes) and type(fields["staging"]) is int)
            if ok:
                sizes = dict(zip(regions, geometry.region_sizes))
                sizes[stage] = fields["staging"]
                out["parts"] = parts_from_wire(layout["parts"], sizes)
                out["peer"] = parse_export(layout["peer"], geometry)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ProtocolError("invalid layout in INFO")
        if state.geometry is not None:
            state.geometry.check_compatible(geometry)
        out.update(geometry=geometry, regions=regions, stage_region=stage)
    return out


# ---- region parts ---------------------------------------------------------------
def register_parts(register, region_parts) -> tuple:
    """Register every part of every region -> (region ids [first part each], parts map, all ids).

    ``register(addr, nbytes) -> id``; ``region_parts``: per region ``((addr, nbytes), ...)``.
    On failure the ids registered so far are in the exception's ``registered`` attribute.
    """
    firsts, parts, every = [], {}, []
    try:
        for region in region_parts:
            start = region[0][0]
            ids = []
            for addr, nbytes in region:
                rid = register(addr, nbytes)
                every.append(rid)
                ids.append((rid, addr - start, nbytes))
            firsts.append(ids[0][0])
            if len(ids) > 1:
                parts[ids[0][0]] = tuple(ids)
    except Exception as exc:
        exc.registered = every
        raise
    return firsts, parts, every


def parts_to_wire(parts: dict) -> list:
    return [[first, [list(p) for p in rows]] for first, rows in parts.items()]


def parts_from_wire(data, sizes: dict) -> dict:
    """Validate a peer's parts; ``sizes``: {first id: region size} of the regions it advertised."""
    if type(data) is not list:
        raise ValueError("parts")
    out = {}
    for item in data:
        first, rows = item
        rows = tuple(tuple(r) for r in rows)
        if first not in sizes or first in out or len(rows) < 2 or rows[0][0] != first:
            raise ValueError("parts")
        at = 0
        for r in rows:
            if len(r) != 3 or not all(type(v) is int for v in r) or r[1] != at or r[2] <= 0:
                raise ValueError("parts")
            at += r[2]
        if at != sizes[first]:
            raise ValueError("parts do not cover their region")
        out[first] = rows
    return out


def _locate(parts: dict, rid: int, off: int) -> tuple:
    rows = parts.get(rid)
    if rows is None:
        return rid, off, 1 << 62
    k = bisect.bisect_right([r[1] for r in rows], off) - 1
    pid, start, nbytes = rows[k]
    return pid, off - start, nbytes - (off - start)


def split_descs(descs: np.ndarray, local: dict, remote: dict) -> np.ndarray:
    """``int64 [n, 5]`` rows (local region, offset, remote region, offset, length) -> the
    same bytes as rows that each stay inside one part on both sides."""
    if not local and not remote:
        return descs
    hit = np.isin(descs[:, 0], list(local)) | np.isin(descs[:, 2], list(remote))
    if not hit.any():
        return descs
    out = []
    for row, cut in zip(descs.tolist(), hit.tolist()):
        if not cut:
            out.append(row)
            continue
        lr, lo, rr, ro, n = row
        pos = 0
        while pos < n:
            l_id, l_off, l_room = _locate(local, lr, lo + pos)
            r_id, r_off, r_room = _locate(remote, rr, ro + pos)
            take = min(n - pos, l_room, r_room)
            out.append([l_id, l_off, r_id, r_off, take])
            pos += take
    return np.array(out, dtype=np.int64).reshape(-1, 5)


# ---- staging rings --------------------------------------------------------------
ALIGN = 256


class StagingRing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[list[int]] = [[0, capacity]]  # sorted [offset, size]
        self._used: dict[int, int] = {}  # offset -> size
        self._waiting: list = []  # (nbytes, callback(offset))
        self._cond = threading.Condition()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return sum(self._used.values())

    def _try_alloc(self, nbytes: int) -> int | None:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = [off + size, free - size]
                self._used[off] = size
                return off
        return None

    def alloc(self, nbytes: int, timeout: float | None = None) -> int | None:
        """Block until ``nbytes`` fit (None after ``timeout``); ValueError if they never can."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} B exceeds the staging capacity of {self.capacity} B")
        got: list = []

        def attempt() -> bool:
            if self._closed:
                return True
            off = None if self._waiting else self._try_alloc(nbytes)
            if off is not None:
                got.append(off)
            return off is not None

        with self._cond:
            self._cond.wait_for(attempt, timeout)
            return got[0] if got else None

    def alloc_async(self, nbytes: int, callback) -> None:
        """Call ``callback(offset)`` now or once space frees (FIFO); may run on the freeing thread."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} B exceeds the staging capacity of {self.capacity} B")
        with self._cond:
            off = None if self._waiting else self._try_alloc(nbytes)
            if off is None:
                self._waiting.append((nbytes, callback))
                return
        callback(off)

    def free(self, offset: int) -> None:
        ready = []
        with self._cond:
            size = self._used.pop(offset)
            self._free.append([offset, size])
            self._free.sort()
            merged = [self._free[0]]
            for off, n in self._free[1:]:
                if merged[-1][0] + merged[-1][1] == off:
                    merged[-1][1] += n
                else:
                    merged.append([off, n])
            self._free = merged
            while self._waiting:
                got = self._try_alloc(self._waiting[0][0])
                if got is None:
                    break
                ready.append((self._waiting.pop(0)[1], got))
            self._cond.notify_all()
        for callback, off in ready:
            callback(off)

    def close(self) -> None:
        """Wake every blocked :meth:`alloc` (it returns None) and drop queued requests."""
        with self._cond:
            self._closed = True
            self._waiting.clear()
            self._cond.notify_all()
