"""A plain-torch Llama decoder (GQA, RMSNorm, SwiGLU, RoPE) with paged attention.

Weights are fp32, dequantized from GGUF; the projections run in the model's
matmul dtype (:mod:`kvxfer.serving.model.linear`: fp32, or bf16 tiles on AMX
CPUs), everything else in fp32. The model reads and writes K/V only
through its :class:`~kvxfer.serving.model.kv_cache.KVCache`; :meth:`LlamaModel.forward`
runs one step (prefill chunks or decode tokens) and returns last-token logits.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .attention import Chunk, StepBatch, paged_attention
from .config import ModelConfig
from .kv_cache import KVCache
from .linear import make_linear, resolve_matmul_dtype
from .rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[T, hidden]`` normalized by its root mean square, times ``weight`` ``[hidden]``.

    torch's fused kernel; the same bits as ``x * rsqrt(mean(x**2) + eps) * weight``."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass
class LayerWeights:
    """One decoder layer; linear weights are ``[out, in]``."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [Hq*D + 2*Hkv*D, hidden]  (q, k, v stacked)
    o: torch.Tensor  # [hidden, Hq*D]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2*inter, hidden]  (gate, up stacked)
    down: torch.Tensor  # [hidden, inter]


@dataclass
class LayerLinears:
    """One layer's projections in the model's matmul dtype (``[T, in] -> [T, out]``)."""

    qkv: object
    o: object
    gate_up: object
    down: object


class LlamaModel:
    """Example::

        model = LlamaModel.from_gguf(None, num_blocks=64)        # embedded SmolLM2
        logits = model.forward([Chunk(prompt_ids, 0, (0, 1))])   # [1, vocab]

    ``matmul_dtype``: ``"fp32"`` (the reference, default), ``"bf16"`` or ``"auto"``
    (:func:`~kvxfer.serving.model.linear.resolve_matmul_dtype`); the resolved
    choice is :attr:`matmul_dtype` and tags the KV pool's layout fingerprint, so
    pools filled with different matmul dtypes refuse to exchange blocks.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 kv_cache: KVCache, *, matmul_dtype: str = "fp32") -> None:
        if kv_cache.num_layers != config.num_layers:
            raise ValueError(f"cache has {kv_cache.num_layers} layers, model {config.num_layers}")
        if tuple(kv_cache.tensor.shape[-2:]) != (config.num_kv_heads, config.head_dim):
            raise ValueError("cache (H, D) does not match the model's kv heads and head dim")
        self.config = config
        self.kv_cache = kv_cache
        self.embed = weights["token_embd.weight"]  # [vocab, hidden]
        self.lm_head = self.embed if config.tied_embeddings else weights["output.weight"]
        self.final_norm = weights["output_norm.weight"]
        self.layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            self.layers.append(LayerWeights(
                attn_norm=weights[p + "attn_norm.weight"],
                qkv=torch.cat([weights[p + n] for n in ("attn_q.weight", "attn_k.weight",
                                                        "attn_v.weight")]),
                o=weights[p + "attn_output.weight"],
                ffn_norm=weights[p + "ffn_norm.weight"],
                gate_up=torch.cat([weights[p + "ffn_gate.weight"], weights[p + "ffn_up.weight"]]),
                down=weights[p + "ffn_down.weight"],
            ))
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position)
        self.scale = config.head_dim ** -0.5
        self._set_matmul(resolve_matmul_dtype(matmul_dtype))

    def _set_matmul(self, dtype: str) -> None:
        self.matmul_dtype = dtype
        self.linears = [LayerLinears(*(make_linear(getattr(w, n), dtype)
                                       for n in ("qkv", "o", "gate_up", "down")))
                        for w in self.layers]
        self.head = make_linear(self.lm_head, dtype)
        self.kv_cache.set_format_tag(self.kv_format_tag)

    @property
    def kv_format_tag(self) -> str:
        """The KV layout's ``byte_format`` tag: ``""`` for fp32, ``"matmul-bf16"`` for bf16."""
        return "" if self.matmul_dtype == "fp32" else f"matmul-{self.matmul_dtype}"

    def with_matmul(self, matmul_dtype: str) -> "LlamaModel":
        """A model sharing these weights and KV pool with another matmul dtype (tests, bench)."""
        other = copy.copy(self)
        other._set_matmul(resolve_matmul_dtype(matmul_dtype))
        return other

    @classmethod
    def from_gguf(cls, path: str | None, *, num_blocks: int, block_size: int = 16,
                  matmul_dtype: str = "fp32") -> "LlamaModel":
        """Load ``path`` (None: the embedded model) and allocate its KV pool."""
        from .gguf_loader import load_weights, open_gguf, read_model_config

        reader = open_gguf(path)
        config = read_model_config(reader)
        cache = KVCache(num_blocks, config.num_layers, block_size, config.num_kv_heads,
                        config.head_dim)
        return cls(config, load_weights(reader, config), cache, matmul_dtype=matmul_dtype)

    def with_cache(self, kv_cache: KVCache) -> "LlamaModel":
        """A model sharing these weights over another KV pool (e.g. a second worker's)."""
        if (kv_cache.num_layers, *kv_cache.tensor.shape[-2:]) != \
                (self.config.num_layers, self.config.num_kv_heads, self.config.head_dim):
            raise ValueError("cache shape does not match the model")
        other = copy.copy(self)
        other.kv_cache = kv_cache
        kv_cache.set_format_tag(self.kv_format_tag)
        return other

    def attention_block(self, layer: int, x: torch.Tensor, batch: StepBatch,
                        rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Pre-norm attention of one layer with residual; ``x`` ``[T, hidden]``.

        ``rope``: the step's ``(cos, sin)`` tables (:meth:`RotaryEmbedding.tables`),
        gathered once per step; computed here when None.
        """
        cfg, w, lin = self.config, self.layers[layer], self.linears[layer]
        cos, sin = rope if rope is not None else self.rope.tables(batch.positions)
        qkv = lin.qkv(rms_norm(x, w.attn_norm, cfg.rms_eps), batch.num_single)
        heads = cfg.num_heads + cfg.num_kv_heads
        # q and k rotated together: [T, Hq + Hkv, D]
        qk = self.rope.rotate(qkv[:, :cfg.q_size + cfg.kv_size].unflatten(-1, (heads, cfg.head_dim)),
                              cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, cfg.q_size + cfg.kv_size:].unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        cache_k, cache_v = self.kv_cache.layer(layer)
        attn = paged_attention(q, k, v, cache_k, cache_v, batch, self.scale)
        return x + lin.o.raw(attn.flatten(1), batch.num_single)  # bf16 + fp32 -> fp32

    def mlp_block(self, layer: int, x: torch.Tensor, small_rows: int | None = None) -> torch.Tensor:
        """Pre-norm SwiGLU MLP of one layer with residual; ``x`` ``[T, hidden]``;
        ``small_rows``: :attr:`StepBatch.num_single` (see :class:`~.linear.TiledLinear`)."""
        w, lin = self.layers[layer], self.linears[layer]
        h = rms_norm(x, w.ffn_norm, self.config.rms_eps)
        gate, up = lin.gate_up(h, small_rows).chunk(2, -1)
        return x + lin.down.raw(F.silu(gate) * up, small_rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of ``hidden`` ``[S, hidden]`` -> ``[S, vocab]``."""
        return self.head(rms_norm(hidden, self.final_norm, self.config.rms_eps))

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Run one step; returns logits ``[S, vocab]`` of each chunk's last token.

        Writes K/V of every chunk token into the pool (positions
        ``start_pos .. end_pos-1`` of each block table) and reads earlier
        positions from it.
        """
        cache = self.kv_cache
        batch = StepBatch(chunks, block_size=cache.block_size, num_blocks=cache.num_blocks,
                          max_position=self.config.max_position)
        x = self.embed[batch.input_ids]  # [T, hidden]
        rope = self.rope.tables(batch.positions)
        for layer in range(self.config.num_layers):
            x = self.attention_block(layer, x, batch, rope)
            x = self.mlp_block(layer, x, batch.num_single)
        return self.logits(x[batch.last_rows])
