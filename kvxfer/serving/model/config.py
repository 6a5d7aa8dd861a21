"""The model's shape: a frozen, validated :class:`ModelConfig`.

It is read from GGUF metadata (``llama.*`` keys) by
:func:`kvxfer.serving.model.gguf_loader.read_model_config`. The engine's budgets
are :class:`kvxfer.serving.engine.config.EngineConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass

# the projections' dtype (kvxfer.serving.model.linear); "auto" resolves by CPU capability
MATMUL_DTYPES = ("auto", "fp32", "bf16")


def check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")



@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (GQA, RMSNorm, SwiGLU, RoPE)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tied_embeddings: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "num_layers", "hidden_size", "intermediate_size", "num_heads",
                        "num_kv_heads", "head_dim", "vocab_size", "max_position")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError("rope_theta and rms_eps must be > 0")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
