"""The simulated worker's KV pool: real, registered, scaled down, verifiable.

A :class:`kvxfer.serving.model.kv_cache.KVCache` of fp32 with one layer and
one head: ``[N, 1, 2, B, 1, D]`` (dims ``"N L 2 B H D"``), ``D`` chosen so a
block holds the real model's block bytes divided by the scale factor
(``kv_scale``, default 256; the exact factor achieved is :attr:`SimPool.scale`).
kvxfer registers and moves it like any pool.

Content: the simulated forward pass writes into each prompt block a ramp
``value + arange(elements)``, ``value`` from the chained hash of the block's
prompt tokens (the last, partial block over the tokens it holds), so equal
prefixes give equal bytes (prefix caching stays sound) and a receiver can
check every byte it was sent (:meth:`SimPool.verify`). Decode tokens write
nothing: their KV is never sent.
"""
from __future__ import annotations

from typing import Sequence as Seq

from ..engine.block_manager import block_hash

DEFAULT_KV_SCALE = 256


def block_values(token_ids: Seq[int], block_size: int, last: int) -> list[int]:
    """The fill value of blocks ``0 .. last`` of a prompt ``token_ids``, each in [0, 2**22): with the ramp, exact in fp32."""
    values, prev = [], None
    for i in range(last + 1):
        prev = block_hash(token_ids[i * block_size:(i + 1) * block_size], prev)
        values.append(prev & 0x3FFFFF)
    return values


class SimPool:
    """Example::

        pool = SimPool(num_blocks=64, block_size=16, real_block_bytes=737280, kv_scale=256)
        pool.cache.kv_layout()          # what the worker's Agent registers
        pool.fill(prompt_ids, block_table, 0, 2); pool.verify(prompt_ids, block_table, 0)
    """

    def __init__(self, num_blocks: int, block_size: int, real_block_bytes: int,
                 kv_scale: float = DEFAULT_KV_SCALE, tag: str = "sim") -> None:
        import torch

        from ..model.kv_cache import KVCache

        if not isinstance(kv_scale, (int, float)) or isinstance(kv_scale, bool) or kv_scale < 1:
            raise ValueError(f"kv_scale must be a number >= 1, got {kv_scale!r}")
        if type(real_block_bytes) is not int or real_block_bytes < 1:
            raise ValueError(f"real_block_bytes must be an int >= 1, got {real_block_bytes!r}")
        per_row = 2 * block_size * 4  # bytes of one unit of D: K and V, B tokens, fp32
        head_dim = max(1, round(real_block_bytes / kv_scale / per_row))
        self.cache = KVCache(num_blocks, 1, block_size, 1, head_dim, dtype=torch.float32)
        self.cache.set_format_tag(tag)
        self.block_size = block_size
        self.real_block_bytes = real_block_bytes
        self.scale = real_block_bytes / self.cache.bytes_per_block
        self._ramp = torch.arange(2 * block_size * head_dim, dtype=torch.float32)
        self._flat = self.cache.tensor.view(num_blocks, -1)

    def fill(self, token_ids: Seq[int], block_table: Seq[int], first: int, last: int) -> None:
        """Write the content of blocks ``first .. last`` of a prompt ``token_ids``."""
        for i, value in enumerate(block_values(token_ids, self.block_size, last)[first:], first):
            self._flat[block_table[i]].copy_(self._ramp + value)

    def verify(self, token_ids: Seq[int], block_table: Seq[int], first: int) -> bool:
        """Whether blocks ``first ..`` of the prompt ``token_ids`` hold its content."""
        import torch

        last = -(-len(token_ids) // self.block_size) - 1
        if last < first:
            return True
        values = torch.tensor(block_values(token_ids, self.block_size, last)[first:],
                              dtype=torch.float32)
        got = self._flat[torch.tensor(list(block_table[first:last + 1]))]
        return bool(torch.equal(got, self._ramp.unsqueeze(0) + values.unsqueeze(1)))
