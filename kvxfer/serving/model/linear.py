"""The model's projections (``x @ w.T``) in the matmul dtype chosen for this CPU.

Batch invariance: a token's projection must have the same bits whatever other
rows share its step (decode tokens of other sequences, a prompt chunk). CPU
GEMM libraries pick their kernel, blocking and threading by the row count:
MKL's fp32 sgemm on an AVX-512 Xeon gives rows of 4-, 8- and 12-row calls
other bits than the same rows of a 16-row or larger call (on an AVX2 EPYC,
every multiple of 4 agreed), and oneDNN's bf16 matmul gives rows 33-512 of one
call other bits than a 32-row call. So every matmul call here has a fixed row
count: the rows of one-token chunks (decode tokens) are padded to a multiple of
:data:`ROW_TILE` and run tile by tile, the rows of longer (prompt) chunks the
same with :data:`PROMPT_TILE`. Each call has one of two shapes, hence one of
two kernels, and a row's bits depend only on that row and on whether its chunk
has one token, which is the same on a prefill and a decode worker that split
the prompt into the same chunks (tests/test_serving_model.py checks row count,
row position and 1 vs 2 threads, in both dtypes).

``fp32``: oneDNN fp32 matmuls on weights prepacked for the tile
(``torch.ops.mkldnn._reorder_linear_weight``: 1.3x faster than ``F.linear``
here at one-sequence decode); plain ``F.linear`` tiles (:class:`TiledLinear`,
the pure reference) where torch has no oneDNN.

``bf16``: weights rounded to bf16 once and prepacked for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``); activations are rounded to bf16,
multiplied with fp32 accumulation, and the bf16 result is widened back to fp32
(norms, rotary, attention, residual and KV pool stay fp32). On AMX this is
5-10x faster than fp32 at prefill and reads half the weight bytes at decode; on
CPUs without AMX bf16 measured slower than fp32, so ``auto`` takes bf16 only
where AMX is present.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MATMUL_DTYPES

# rows of every matmul call: decode steps of up to 16 sequences are one call. 32 made a
# one-sequence decode step 1.15x (bf16) to 1.25x (fp32) slower, a 1,000-token prefill 1.1x faster
ROW_TILE = 16
# rows of every call over prompt-chunk rows (chunks of > 1 token): 4x fewer calls than 16
# for a long prompt; a token's chunk length is the same on P and D (same chunk splits)
PROMPT_TILE = 64


def bf16_supported() -> bool:
    """True when torch's oneDNN can run prepacked bf16 linears on this CPU (AVX-512 BF16)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()))


def amx_available() -> bool:
    """True when the CPU has AMX tiles (``amx_tile``: the bf16 matmuls that beat fp32)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def resolve_matmul_dtype(choice: str) -> str:
    """``"auto"``, ``"fp32"`` or ``"bf16"`` -> ``"fp32"`` or ``"bf16"`` for this CPU.

    ``auto`` is decided by CPU capability (AMX and bf16 oneDNN kernels), never by
    a timing, so two workers on the same CPU model always agree.
    """
    if choice not in MATMUL_DTYPES:
        raise ValueError(f"matmul dtype must be one of {MATMUL_DTYPES}, got {choice!r}")
    if choice == "auto":
        return "bf16" if bf16_supported() and amx_available() else "fp32"
    if choice == "bf16" and not bf16_supported():
        raise ValueError("matmul dtype bf16 needs torch with oneDNN and a CPU with AVX-512 BF16")
    return choice


class TiledLinear:
    """``x`` ``[T, in]`` fp32 -> ``x @ weight.T`` ``[T, out]`` fp32 in calls of fixed row counts.

    ``weight`` ``[out, in]`` fp32. ``__call__(x, small_rows)``: rows
    ``0 .. small_rows-1`` (one-token chunks; default: all rows) run in calls of
    ``tile`` rows, the rest (prompt-chunk rows) in calls of ``prompt_tile`` rows.
    """

    def __init__(self, weight: torch.Tensor, tile: int = ROW_TILE,
                 prompt_tile: int = PROMPT_TILE) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
        self.tile = tile
        self.prompt_tile = prompt_tile
        self.out_features, self.in_features = weight.shape
        self.weight = weight

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def __call__(self, x: torch.Tensor, small_rows: int | None = None) -> torch.Tensor:
        return self.raw(x, small_rows).float()

    def raw(self, x: torch.Tensor, small_rows: int | None = None) -> torch.Tensor:
        """``[T, out]`` in the compute dtype (bf16 or fp32): for adding into an fp32 residual."""
        x = self._prepare(x)
        rows = x.shape[0]
        small = rows if small_rows is None else small_rows
        if small == rows:
            return self._tiled(x, self.tile)
        if small == 0:
            return self._tiled(x, self.prompt_tile)
        return torch.cat([self._tiled(x[:small], self.tile),
                          self._tiled(x[small:], self.prompt_tile)])

    def _tiled(self, x: torch.Tensor, tile: int) -> torch.Tensor:
        rows = x.shape[0]
        pad = -rows % tile
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        if x.shape[0] == tile:
            return self._mm(x)[:rows]
        return torch.cat([self._mm(t) for t in x.split(tile)])[:rows]


class PackedTiledLinear(TiledLinear):
    """:class:`TiledLinear` through oneDNN matmuls on a weight prepacked once for the tile.

    ``dtype`` ``torch.float32`` (fp32 throughout) or ``torch.bfloat16`` (``weight``
    ``[out, in]`` rounded to bf16, activations rounded to bf16, fp32 accumulation,
    bf16 result).
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32,
                 tile: int = ROW_TILE, prompt_tile: int = PROMPT_TILE) -> None:
        super().__init__(weight, tile, prompt_tile)
        self.dtype = dtype
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), tile)

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


def make_linear(weight: torch.Tensor, dtype: str):
    """The projection for ``weight`` ``[out, in]`` in resolved ``dtype`` (``"fp32"``/``"bf16"``)."""
    if dtype == "fp32":
        if torch.backends.mkldnn.is_available():
            return PackedTiledLinear(weight, torch.float32)
        return TiledLinear(weight)
    if dtype == "bf16":
        return PackedTiledLinear(weight, torch.bfloat16)
    raise ValueError(f"resolved matmul dtype must be 'fp32' or 'bf16', got {dtype!r}")
