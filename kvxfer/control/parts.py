"""Regions registered in parts: descriptors cut where a device allocation ends.

A region (the addressing unit of :class:`~kvxfer.transport.descriptors.Geometry`, a staging
buffer) is registered as one or more *parts*, each inside one device
allocation (:meth:`KVLayout.region_parts`; with PyTorch's ``expandable_segments``
one tensor spans several physical chunks, and a backend registration may not
cross them). Descriptors name a region by its first part's id with offsets from
the region's start; :func:`split_descs` rewrites the rows that cross a part
boundary on either side into per-part rows just before they are posted.

Parts map: ``{first part id: ((part id, offset in region, nbytes), ...)}``, only
for regions of more than one part (empty on CPU and for ``cudaMalloc`` pools,
where nothing is rewritten).
"""
from __future__ import annotations

import bisect

import numpy as np


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


def to_wire(parts: dict) -> list:
    return [[first, [list(p) for p in rows]] for first, rows in parts.items()]


def from_wire(data, sizes: dict) -> dict:
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
