"""Zero-copy descriptors: from two pools and two lists of block ids to the backend's
``int64 [n, 5]`` rows (local region, local offset, remote region, remote offset, length).

:class:`Geometry` is the part of a :class:`~kvxfer.KVLayout` a *peer* needs:
sizes, this rank's global head range, and for each (layer, kv) plane its
region, byte offset and byte strides ``(N, B, H, D)``. It crosses the control
channel (after authentication) so that P can compute byte addresses in D's pool.

:func:`zero_copy_descs` emits one descriptor per contiguous run, straight from
P's pool into D's pool. Runs are found per block "tile" ``[B, heads, D]`` by
walking both tiles in the same element order (memory order when both planes
have the same inner strides, the wire order ``B, H, D`` otherwise) and cutting
wherever either side stops being contiguous; runs adjacent across blocks, K/V
and layers are then coalesced. :func:`count_runs` bounds their number for the
cost model (:mod:`.paths`), which picks between this path and pack.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property, lru_cache

import numpy as np

from .._dims import strided_nbytes
from ..errors import LayoutMismatch, ProtocolError


@dataclass(frozen=True)
class Geometry:
    fingerprint: str
    num_layers: int
    num_kv: int
    num_blocks: int
    block_size: int
    num_heads: int  # local heads
    head_dim: int
    itemsize: int
    head_lo: int  # first global head held
    planes: tuple  # [layer * num_kv + kv] -> (region_index, offset, sN, sB, sH, sD)
    region_sizes: tuple

    @property
    def head_range(self) -> tuple:
        return (self.head_lo, self.head_lo + self.num_heads)

    @cached_property
    def _hash_value(self) -> int:
        # a peer's geometry keys the descriptor caches on every request: hash its planes
        # once (cached_property writes the instance dict; the dataclass stays frozen)
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:
        return self._hash_value

    @cached_property
    def _plane_cache(self) -> dict:
        """Per-geometry memo of plane columns and descriptor templates (see below)."""
        return {}

    @cached_property
    def is_uniform(self) -> bool:
        """Every plane has the same strides (the usual case): describe all planes in one numpy pass."""
        return len({p[2:] for p in self.planes}) == 1

    def plane(self, layer: int, kv: int) -> tuple:
        return self.planes[layer * self.num_kv + kv]

    @classmethod
    def from_layout(cls, layout) -> "Geometry":
        spans = layout.regions()
        planes = []
        for layer in range(layout.num_layers):
            for kv in range(layout.num_kv):
                p = layout.planes[layer][kv]
                addr = layout.tensors[p.tensor_index].data_ptr() + p.offset
                idx = next(i for i, (a, n) in enumerate(spans) if a <= addr < a + n)
                planes.append((idx, addr - spans[idx][0], *p.strides))
        return cls(layout.fingerprint(), layout.num_layers, layout.num_kv, layout.num_blocks,
                   layout.block_size, layout.num_heads, layout.head_dim, layout.itemsize,
                   layout.head_range[0], tuple(planes), tuple(n for _, n in spans))

    def to_wire(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}  # not the memo caches
        out["planes"] = [list(p) for p in self.planes]
        out["region_sizes"] = list(self.region_sizes)
        return out

    @classmethod
    def from_wire(cls, d) -> "Geometry":
        """Validate a peer's geometry; every byte it can name lies inside its regions."""
        try:
            ints = {k: d[k] for k in ("num_layers", "num_kv", "num_blocks", "block_size",
                                      "num_heads", "head_dim", "itemsize", "head_lo")}
            if set(d) != set(ints) | {"fingerprint", "planes", "region_sizes"}:
                raise ValueError("fields")
            if not all(type(v) is int and 0 <= v < (1 << 40) for v in ints.values()):
                raise ValueError("ints")
            if min(v for k, v in ints.items() if k != "head_lo") < 1 or ints["num_kv"] > 2:
                raise ValueError("sizes")
            sizes = tuple(d["region_sizes"])
            planes = tuple(tuple(p) for p in d["planes"])
            if type(d["fingerprint"]) is not str or len(planes) != ints["num_layers"] * ints["num_kv"]:
                raise ValueError("planes")
            if not all(type(n) is int and n > 0 for n in sizes):
                raise ValueError("regions")
            dims = (ints["num_blocks"], ints["block_size"], ints["num_heads"], ints["head_dim"])
            for p in planes:
                if len(p) != 6 or not all(type(v) is int and v >= 0 for v in p) or p[0] >= len(sizes):
                    raise ValueError("plane")
                if p[1] + strided_nbytes(dims, p[2:], ints["itemsize"]) > sizes[p[0]]:
                    raise ValueError("plane outside its region")
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"invalid layout geometry from peer ({exc})") from None
        return cls(d["fingerprint"], planes=planes, region_sizes=sizes, **ints)

    def check_compatible(self, other: "Geometry") -> None:
        if self.fingerprint != other.fingerprint:
            raise LayoutMismatch(f"pools cannot be converted: {self.fingerprint} vs {other.fingerprint}")


def overlap(a: tuple, b: tuple) -> tuple | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@lru_cache(maxsize=256)
def _tile_runs(item: int, B: int, nh: int, D: int, s_str: tuple, d_str: tuple, s0: int, d0: int):
    """Runs ``(src_rel, dst_rel, nbytes)`` covering one block tile ``[B, nh, D]``: block ->
    block between two layouts (block -> wire runs of one layout are
    :func:`kvxfer.runs.block_runs`')."""
    sizes = (B, nh, D)
    order = (0, 1, 2)
    if s_str == d_str:  # same inner layout: walk in memory order for the longest runs
        order = tuple(sorted(range(3), key=lambda i: -s_str[i]))
    idx = np.indices([sizes[i] for i in order]).reshape(3, -1)
    src = s0 + sum(idx[j] * s_str[order[j]] for j in range(3))
    dst = d0 + sum(idx[j] * d_str[order[j]] for j in range(3))
    brk = np.flatnonzero((np.diff(src) != item) | (np.diff(dst) != item)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [src.size]))) * item
    return src[starts], dst[starts], lens


def tile_runs(src: Geometry, sp: tuple, dst: Geometry, dp: tuple, heads: tuple):
    s0 = (heads[0] - src.head_lo) * sp[4]  # relative to the block's first byte
    d0 = (heads[0] - dst.head_lo) * dp[4]
    return _tile_runs(src.itemsize, src.block_size, heads[1] - heads[0], src.head_dim,
                      tuple(sp[3:]), tuple(dp[3:]), s0, d0)


def count_runs(src: Geometry, dst: Geometry, num_ids: int, layers, heads) -> int:
    """Upper bound of zero-copy descriptors (before coalescing across tiles)."""
    if src.is_uniform and dst.is_uniform:
        runs = len(tile_runs(src, src.planes[0], dst, dst.planes[0], heads)[2])
        return runs * num_ids * len(layers) * src.num_kv
    return sum(len(tile_runs(src, src.plane(l, kv), dst, dst.plane(l, kv), heads)[2]) * num_ids
               for l in layers for kv in range(src.num_kv))


def _plane_cols(g: Geometry, layers, num_kv: int):
    """``(region ids index, offsets)`` of the selected planes, in (layer, kv) order."""
    key = ("_cols", tuple(layers))
    cache = g._plane_cache
    cols = cache.get(key)
    if cols is None:
        sel = [g.planes[l * num_kv + kv] for l in layers for kv in range(num_kv)]
        cols = (np.array([p[0] for p in sel], dtype=np.int64), np.array([p[1] for p in sel], dtype=np.int64))
        if len(cache) < 64:
            cache[key] = cols
    return cols


def _template(src: Geometry, dst: Geometry, layers: tuple, heads: tuple, src_regions: tuple,
              dst_regions: tuple) -> np.ndarray:
    """Descriptors of block 0 -> block 0 for every selected plane, ``int64 [plane, run, 5]``
    (cached: a request then only adds ``id * stride_n`` to the offset columns)."""
    cache = src._plane_cache
    key = ("_tmpl", dst, layers, heads, src_regions, dst_regions)
    base = cache.get(key)
    if base is None:
        s_rel, d_rel, lens = tile_runs(src, src.planes[0], dst, dst.planes[0], heads)
        s_reg, s_off = _plane_cols(src, layers, src.num_kv)
        d_reg, d_off = _plane_cols(dst, layers, dst.num_kv)
        base = np.empty((s_off.size, lens.size, 5), dtype=np.int64)
        base[..., 0] = np.asarray(src_regions, dtype=np.int64)[s_reg][:, None]
        base[..., 1] = s_off[:, None] + s_rel[None, :]
        base[..., 2] = np.asarray(dst_regions, dtype=np.int64)[d_reg][:, None]
        base[..., 3] = d_off[:, None] + d_rel[None, :]
        base[..., 4] = lens[None, :]
        if len(cache) >= 64:
            cache.clear()
        cache[key] = base
    return base


def _template1(src: Geometry, dst: Geometry, layers: tuple, heads: tuple, src_regions: tuple,
               dst_regions: tuple) -> np.ndarray:
    """Coalesced descriptors of block 0 -> block 0 over the selected planes, ``int64 [n, 5]`` (cached)."""
    cache = src._plane_cache
    key = ("_tmpl1", dst, layers, heads, src_regions, dst_regions)
    out = cache.get(key)
    if out is None:
        out = coalesce(_template(src, dst, layers, heads, src_regions, dst_regions).reshape(-1, 5))
        out.flags.writeable = False
        if len(cache) >= 64:
            cache.clear()
        cache[key] = out
    return out


def zero_copy_descs(src: Geometry, src_ids, dst: Geometry, dst_ids, layers, heads,
                    src_regions, dst_regions) -> np.ndarray:
    """Coalesced ``int64 [n, 5]`` descriptors (local_region, local_off, remote_region, remote_off, len).

    ``src_regions``/``dst_regions`` map region index -> backend region id.
    """
    layers = tuple(layers)
    if len(src_ids) == 1 and len(dst_ids) == 1 and layers and src.is_uniform and dst.is_uniform:
        # one block: coalescing is invariant under shifting every row by the same
        # offsets, so the coalesced template is cached and only shifted per request
        out = _template1(src, dst, layers, heads, tuple(src_regions), tuple(dst_regions)).copy()
        out[:, 1] += int(src_ids[0]) * src.planes[0][2]
        out[:, 3] += int(dst_ids[0]) * dst.planes[0][2]
        return out
    sids = np.asarray(src_ids, dtype=np.int64)
    dids = np.asarray(dst_ids, dtype=np.int64)
    if src.is_uniform and dst.is_uniform and layers:
        key = (tuple(src_regions), tuple(dst_regions))
        base = _template(src, dst, layers, heads, *key)
        if len(_template1(src, dst, layers, heads, *key)) < base.shape[0] * base.shape[1]:
            # a block's planes touch on both sides (e.g. "N L 2 B H D" pools): block-major
            # rows coalesce into one run per block (2 MiB for Llama-3-8B instead of 32 KiB)
            out = np.repeat(base[None], sids.size, axis=0)  # [block, plane, run, 5]
            out[..., 1] += (sids * src.planes[0][2])[:, None, None]
            out[..., 3] += (dids * dst.planes[0][2])[:, None, None]
        else:  # plane-major: consecutive block ids coalesce within each plane
            out = np.repeat(base[:, None], sids.size, axis=1)  # [plane, block, run, 5]
            out[..., 1] += (sids * src.planes[0][2])[None, :, None]
            out[..., 3] += (dids * dst.planes[0][2])[None, :, None]
        return coalesce(out.reshape(-1, 5))
    parts = []
    for layer in layers:
        for kv in range(src.num_kv):
            sp, dp = src.plane(layer, kv), dst.plane(layer, kv)
            s_rel, d_rel, lens = tile_runs(src, sp, dst, dp, heads)
            k = lens.size
            out = np.empty((sids.size * k, 5), dtype=np.int64)
            out[:, 0] = src_regions[sp[0]]
            out[:, 1] = (sp[1] + sids[:, None] * sp[2] + s_rel[None, :]).ravel()
            out[:, 2] = dst_regions[dp[0]]
            out[:, 3] = (dp[1] + dids[:, None] * dp[2] + d_rel[None, :]).ravel()
            out[:, 4] = np.tile(lens, sids.size)
            parts.append(out)
    descs = np.concatenate(parts) if parts else np.empty((0, 5), dtype=np.int64)
    return coalesce(descs)


def coalesce(descs: np.ndarray) -> np.ndarray:
    """Merge neighbours contiguous on both sides (same regions, touching offsets)."""
    if len(descs) < 2:
        return descs
    a, b = descs[:-1], descs[1:]
    joins = ((a[:, 0] == b[:, 0]) & (a[:, 2] == b[:, 2])
             & (a[:, 1] + a[:, 4] == b[:, 1]) & (a[:, 3] + a[:, 4] == b[:, 3]))
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    out = descs[starts].copy()
    out[:, 4] = np.add.reduceat(descs[:, 4], starts)
    return out
