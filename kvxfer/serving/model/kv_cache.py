"""The paged KV pool: one tensor, allocated once; layers and kvxfer get views.

Layout ``[N, L, 2, B, H, D]`` (dims ``"N L 2 B H D"``): ``N`` blocks, ``L``
layers, K/V, ``B`` tokens per block, ``H`` kv heads, ``D`` head dim. One
block across all layers (``tensor[n]``) is one contiguous run of
``bytes_per_block`` bytes, so a request's KV moves as a few large copies.
Token ``t`` of a sequence with block table ``bt`` lives in block
``bt[t // B]`` at offset ``t % B``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvxfer import KVLayout


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
        self._layers = [(self.tensor[:, i, 0], self.tensor[:, i, 1]) for i in range(num_layers)]
        self.format_tag = ""  # the layout's byte_format: who filled the pool (set by the model)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (one contiguous run)."""
        return self.tensor[0].numel() * self.tensor.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` views ``[N, B, H, D]`` of one layer (not contiguous: stride over N is a block)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return self._layers[layer]

    def set_format_tag(self, tag: str) -> None:
        """Tag the layout fingerprint (e.g. ``"matmul-bf16"``): pools exchange blocks only with
        pools of the same tag. Must come before :meth:`kv_layout` is registered anywhere."""
        if tag != self.format_tag:
            self.format_tag = tag
            self._layout = None

    def kv_layout(self) -> "KVLayout":
        """The pool as a :class:`kvxfer.KVLayout` (built on first call, then cached)."""
        if self._layout is None:
            from kvxfer import KVLayout

            self._layout = KVLayout.from_tensors(self.tensor, self.DIMS,
                                                 byte_format=self.format_tag)
        return self._layout
