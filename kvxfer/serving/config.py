"""Frozen, validated configuration: the model's shape and the engine's budgets.

:class:`ModelConfig` is read from GGUF metadata (``llama.*`` keys) by
:func:`kvxfer.serving.gguf_loader.read_model_config`; :class:`EngineConfig` is
built once at the entry point (CLI, worker) and passed down.
"""
from __future__ import annotations

from dataclasses import dataclass


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


SCHEDULES = ("mixed", "separate")


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
        _check_positive(self, "num_layers", "hidden_size", "intermediate_size", "num_heads",
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


@dataclass(frozen=True)
class EngineConfig:
    """Budgets of one engine: KV pool size, batch limits, threads.

    ``num_blocks`` KV blocks of ``block_size`` tokens are allocated once.
    A prefill step takes at most ``max_num_batched_tokens`` prompt tokens
    (longer prompts are prefilled in chunks); a decode step at most
    ``max_num_seqs`` sequences. ``schedule``: ``"mixed"`` puts the decode
    tokens and prompt chunks in the same step (the budget counts both),
    ``"separate"`` runs prefill steps and decode steps apart (see
    :mod:`kvxfer.serving.scheduler`). ``num_threads`` (if set) is applied with
    ``torch.set_num_threads`` when the engine starts.
    """

    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    num_blocks: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    schedule: str = "mixed"

    def __post_init__(self) -> None:
        _check_positive(self, "num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.num_threads is not None:
            _check_positive(self, "num_threads")
        if self.model_path is not None and not isinstance(self.model_path, str):
            raise TypeError(f"model_path must be a str or None, got {type(self.model_path).__name__}")
