"""Rotary position embedding over adjacent pairs (GGUF / Meta interleaved layout).

GGUF q/k weights are stored permuted so that rotary pairs are adjacent:
dimension pair ``i`` is ``(x[2i], x[2i+1])`` with frequency
``theta ** (-2i / head_dim)``. (Hugging Face checkpoints pair ``x[i]`` with
``x[i + head_dim/2]`` instead; llama.cpp's converter permutes to this layout.)
"""
from __future__ import annotations

import torch


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[max_position, head_dim/2]`` (fp32)."""

    def __init__(self, head_dim: int, theta: float, max_position: int) -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        self.cos = angles.cos().to(torch.float32)
        self.sin = angles.sin().to(torch.float32)
        self.max_position = max_position

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, D]`` at ``positions`` ``[T]``, gathered once per step:
        each pair's cosine twice, and its sine as ``(-sin, sin)``."""
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D/2]
        return (cos.repeat_interleave(2, -1).unsqueeze(1),
                torch.stack((-sin, sin), dim=-1).flatten(-2).unsqueeze(1))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, D]`` by tables from :meth:`tables`; returns a new ``[T, H, D]``.

        Pair ``(x0, x1)`` -> ``(x0*cos - x1*sin, x1*cos + x0*sin)``: four tensor ops."""
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0) per pair
        return x * cos + swapped * sin

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, D]`` at ``positions`` ``[T]``; returns a new ``[T, H, D]``."""
        return self.rotate(x, *self.tables(positions))
