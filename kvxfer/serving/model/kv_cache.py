"""The paged KV pool: one tensor, allocated once; layers and kvxfer get views.

Layout ``[N, L, 2, B, H, D]`` (dims ``"N L 2 B H D"``): ``N`` blocks, ``L``
layers, K/V, ``B`` tokens per block, ``H`` kv heads, ``D`` head dim. One
block across all layers (``tensor[n]``) is one contiguous run of
``bytes_per_block`` bytes, so a request's KV moves as a few large copies.
Token ``t`` of a sequence with block table ``bt`` lives in block
``bt[t // B]`` at offset ``t % B``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from kvxfer.layout import KVLayout


class KVCache:
    """Example::

        cache = KVCache(num_blocks=64, num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
        k0, v0 = cache.layer(0)            # each [N, B, H, D], views of cache.tensor
        layout = cache.kv_layout()         # kvxfer.KVLayout over cache.tensor
    """

    DIMS = "N L 2 B H D"

    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        for name, value in (("num_blocks", num_blocks), ("num_layers", num_layers),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        # zeros, not empty: an unwritten slot is never read, but a transfer of one is reproducible
        self.tensor = torch.zeros(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self._layout: KVLayout | None = None

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (one contiguous run)."""
        return self.tensor[0].numel() * self.tensor.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` views ``[N, B, H, D]`` of one layer (not contiguous: stride over N is a block)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.tensor[:, layer, 0], self.tensor[:, layer, 1]

    def _check_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks}), got {list(block_ids)}")
        return ids

    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy whole blocks (all layers) ``src_ids[i] -> dst_ids[i]`` within this pool."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source ids but {len(dst_ids)} destination ids")
        src, dst = self._check_ids(src_ids), self._check_ids(dst_ids)
        self.tensor[dst] = self.tensor[src]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the given blocks, ``[n, L, 2, B, H, D]``."""
        return self.tensor[self._check_ids(block_ids)]

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` ``[n, L, 2, B, H, D]`` (e.g. from another pool) into ``block_ids``."""
        ids = self._check_ids(block_ids)
        expected = (len(ids), *self.tensor.shape[1:])
        if tuple(data.shape) != expected or data.dtype != self.tensor.dtype:
            raise ValueError(f"data must be {expected} {self.tensor.dtype}, "
                             f"got {tuple(data.shape)} {data.dtype}")
        self.tensor[ids] = data.to(self.tensor.device)

    def kv_layout(self) -> "KVLayout":
        """The pool as a :class:`kvxfer.KVLayout` (built on first call, then cached)."""
        if self._layout is None:
            from kvxfer.layout import KVLayout

            self._layout = KVLayout.from_tensors(self.tensor, self.DIMS)
        return self._layout
