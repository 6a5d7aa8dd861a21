"""Engine layouts for the pack/layout tests: tiny, random bytes, every dims kind.

Each maker takes (dtype, seed, **sizes, device) and returns a KVLayout over
fresh tensors whose every byte (padding included) is random, so copies that
read or write the wrong bytes show up in byte-wise comparisons. The bytes come
from a CPU generator (the same for every device) and are moved once, before
any view is taken, so views, transposes and slices are made on the device.
"""
from __future__ import annotations

import torch

from kvxfer.layout import KVLayout

L, N, B, H, D = 3, 7, 2, 4, 8
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def _rand(shape, dtype, gen, device):
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * item), dtype=torch.uint8, generator=gen)
    return raw.to(device).view(dtype)


def make(kind: str, dtype=torch.bfloat16, seed: int = 0, *, layers=L, blocks=N, bs=B, heads=H, hd=D,
         tp_rank=0, tp_size=1, device="cpu") -> KVLayout:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: _rand(s, dtype, g, device)  # noqa: E731
    kw = dict(tp_rank=tp_rank, tp_size=tp_size)
    if kind == "vllm":  # [2, N, B, H, D] per layer
        return KVLayout.vllm([r(2, blocks, bs, heads, hd) for _ in range(layers)], **kw)
    if kind == "vllm_blocks_first":
        return KVLayout.vllm({f"l{i}": r(blocks, 2, bs, heads, hd) for i in range(layers)}, blocks_first=True, **kw)
    if kind == "vllm_hnd_strides":  # logical NHD shape, physical HND strides
        return KVLayout.vllm([r(blocks, 2, heads, bs, hd).transpose(2, 3) for _ in range(layers)],
                             blocks_first=True, **kw)
    if kind == "flashinfer_hnd":
        return KVLayout.flashinfer([r(blocks, 2, heads, bs, hd) for _ in range(layers)], kv_layout="HND", **kw)
    if kind == "flashinfer_kv_pair":
        return KVLayout.flashinfer(([r(blocks, bs, heads, hd) for _ in range(layers)],
                                    [r(blocks, bs, heads, hd) for _ in range(layers)]), **kw)
    if kind == "sglang":
        pools = lambda: [r(blocks * bs + 1, heads, hd) for _ in range(layers)]  # noqa: E731
        return KVLayout.sglang(pools(), pools(), page_size=bs, **kw)
    if kind == "cross_layer_blocks_outer":  # "N L 2 B H D": a block is contiguous across layers
        return KVLayout.from_tensors(r(blocks, layers, 2, bs, heads, hd), "N L 2 B H D", **kw)
    if kind == "cross_layer_layers_outer":
        return KVLayout.from_tensors(r(layers, 2, blocks, bs, heads, hd), "L 2 N B H D", **kw)
    if kind == "kv_cross_tensors":  # K and V each one cross-layer tensor, HND
        return KVLayout.from_tensors({"k": r(layers, blocks, heads, bs, hd), "v": r(layers, blocks, heads, bs, hd)},
                                     "L N H B D", **kw)
    if kind == "padded_rows":  # head_dim padded: rows not adjacent
        return KVLayout.from_tensors([r(blocks, 2, bs, heads, hd + 3)[..., :hd] for _ in range(layers)],
                                     "N 2 B H D", **kw)
    if kind == "strided_dim":  # head_dim stride 2: element-sized rows
        return KVLayout.from_tensors([r(2, blocks, bs, heads, 2 * hd)[..., ::2] for _ in range(layers)],
                                     "2 N B H D", **kw)
    if kind == "pool_views":  # per-layer views into one storage, blocks padded
        big = r(layers, blocks + 1, 2, bs, heads, hd)
        return KVLayout.from_tensors([big[i, 1:] for i in range(layers)], "N 2 B H D", **kw)
    if kind == "mla":
        return KVLayout.vllm([r(blocks, bs, 2 * hd) for _ in range(layers)])
    raise KeyError(kind)


KINDS = ("vllm", "vllm_blocks_first", "vllm_hnd_strides", "flashinfer_hnd", "flashinfer_kv_pair", "sglang",
         "cross_layer_blocks_outer", "cross_layer_layers_outer", "kv_cross_tensors", "padded_rows",
         "strided_dim", "pool_views", "mla")


def storage_bytes(layout) -> list:
    """Every storage of the pool as a uint8 clone (padding included)."""
    seen, out = set(), []
    for t in layout.tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).clone())
    return out


def same_storage(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(storage_bytes(a), storage_bytes(b)))
