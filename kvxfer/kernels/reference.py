"""Pure-torch reference pack/unpack: the definition of the wire format in code.

Independent of :class:`~kvxfer.runs.TileCopy` geometry (it indexes the layout's
``[N, B, H, D]`` views directly), so tests compare every fast path with it.
Wire bytes are ``[layers, kv, n, B, heads, D]`` of the layout dtype, contiguous.
"""
from __future__ import annotations

from .common import INT_DTYPE_NAMES, prepare_pack, prepare_unpack


def _wire_and_views(layout, job, buf):
    import torch

    int_dtype = getattr(torch, INT_DTYPE_NAMES[layout.itemsize])
    h0 = job.heads[0] - layout.head_range[0]
    h1 = job.heads[1] - layout.head_range[0]
    shape = (len(job.layers), layout.num_kv, job.ids.size, layout.block_size, h1 - h0, layout.head_dim)
    wire = buf.view(int_dtype).view(shape)
    ids = torch.as_tensor(job.ids, device=layout.device)
    views = [[layout.kv_view(l, kv).view(int_dtype)[:, :, h0:h1] for kv in range(layout.num_kv)]
             for l in job.layers]
    return wire, ids, views


def pack(layout, block_ids, *, layers=None, heads=None, out=None):
    """Gather blocks into wire bytes: uint8 ``[wire_nbytes]`` (see :func:`kvxfer.pack`)."""
    job, buf = prepare_pack(layout, block_ids, layers, heads, out)
    if job.nbytes:
        wire, ids, views = _wire_and_views(layout, job, buf)
        for j, per_kv in enumerate(views):
            for kv, view in enumerate(per_kv):
                wire[j, kv] = view[ids]
    return buf


def unpack(layout, buf, block_ids, *, layers=None, heads=None) -> None:
    """Scatter wire bytes back into the blocks (see :func:`kvxfer.unpack`)."""
    job, buf = prepare_unpack(layout, buf, block_ids, layers, heads)
    if job.nbytes:
        wire, ids, views = _wire_and_views(layout, job, buf)
        for j, per_kv in enumerate(views):
            for kv, view in enumerate(per_kv):
                view[ids] = wire[j, kv]


def copy_blocks(src, src_ids, dst, dst_ids, *, layers=None, heads=None) -> None:
    """Blocks of ``src`` into blocks of ``dst`` (see :func:`kvxfer.kernels.copy_blocks`):
    the reference pack of the source, unpacked into the destination."""
    from ..runs import normalize_ids

    wire = pack(src, src_ids, layers=layers, heads=heads)
    n = normalize_ids(dst_ids, dst.num_blocks, unique=True).size
    if wire.numel() != dst.wire_nbytes(n, layers, heads):
        raise ValueError(f"src_ids and dst_ids name different numbers of blocks (dst_ids: {n})")
    unpack(dst, wire, dst_ids, layers=layers, heads=heads)
