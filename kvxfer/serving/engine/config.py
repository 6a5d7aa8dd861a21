"""The engine's budgets: a frozen, validated :class:`EngineConfig`.

Built once at the entry point (CLI, worker) and passed down.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.config import MATMUL_DTYPES, check_positive

SCHEDULES = ("mixed", "separate", "prefill-first")
PREEMPTIONS = ("recompute", "swap")


def parse_cpu_group(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: expected e.g. '0', '0-3', '0,2'") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return tuple(dict.fromkeys(cpus))


@dataclass(frozen=True)
class EngineConfig:
    """Budgets of one engine: KV pool size, batch limits, threads.

    ``num_blocks`` KV blocks of ``block_size`` tokens are allocated once.
    A prefill step takes at most ``max_num_batched_tokens`` prompt tokens
    (longer prompts are prefilled in chunks); a decode step at most
    ``max_num_seqs`` sequences. ``schedule``: ``"mixed"`` puts the decode
    tokens and prompt chunks in the same step (the budget counts both),
    ``"separate"`` runs prefill steps and decode steps apart, ``"prefill-first"``
    too, with whole prompts (vLLM without chunked prefill; see
    :mod:`kvxfer.serving.engine.scheduler`). ``preemption``: what a decode that
    runs out of blocks does to the newest sequence, ``"recompute"`` (vLLM's default)
    or ``"swap"`` (DistServe's decode instance; the simulated engines only, which
    model the swap's time). ``num_threads`` (if set) is applied with
    ``torch.set_num_threads`` when the engine starts. ``matmul_dtype``: the
    projections' dtype, ``"auto"`` (bf16 on CPUs with AMX, else fp32), ``"fp32"``
    or ``"bf16"`` (see :mod:`kvxfer.serving.model.linear`); a prefill/decode pair
    must resolve to the same one (their KV layout fingerprints differ otherwise).
    """

    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    num_blocks: int = 1024  # the default of every entry point (serve, worker, Engine)
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    schedule: str = "mixed"
    matmul_dtype: str = "auto"
    preemption: str = "recompute"  # a decode out of blocks: recompute the newest, or swap it out

    def __post_init__(self) -> None:
        check_positive(self, "num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {PREEMPTIONS}, got {self.preemption!r}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, "
                             f"got {self.matmul_dtype!r}")
        if self.num_threads is not None:
            check_positive(self, "num_threads")
        if self.model_path is not None and not isinstance(self.model_path, str):
            raise TypeError(f"model_path must be a str or None, got {type(self.model_path).__name__}")
