"""Cluster configuration names of the virtual clock, parsed into :class:`ServeConfig`.

Grammar (case-insensitive):

- ``colocated:N``: N colocated workers, chunked prefill (``--colocated N``);
- ``xPyD`` (e.g. ``2P6D``): x prefill and y decode workers (``--prefill x --decode y``);
- ``conditional:xPyD``: xPyD with conditional disaggregation, a prompt prefilled on its
  decode worker when its uncached part is under ``LOCAL_PREFILL_TOKENS`` tokens or the
  prefill worker holds ``LOCAL_PREFILL_QUEUE`` requests (``--local-prefill-tokens``,
  ``--local-prefill-queue``);
- ``adaptive:xPyD``: xPyD to start with, workers moved between the roles by the
  rebalancer's policy (``--adaptive``, default thresholds).

:func:`configs_for` lists every configuration of N accelerators, what ``kvxfer plan`` sweeps.
"""
from __future__ import annotations

import re

from ..errors import KVXferError
from ..serving.server.adaptive_policy import AdaptivePolicy
from ..serving.server.serve_config import ServeConfig

LOCAL_PREFILL_TOKENS = 1024  # two Mooncake hash blocks
LOCAL_PREFILL_QUEUE = 4

_SPLIT = re.compile(r"(\d+)P(\d+)D", re.IGNORECASE)


class ConfigError(KVXferError, ValueError):
    """A cluster configuration name that the grammar (module docstring) does not accept."""


def parse_config(name: str, *, slo_ms: tuple[float, float] | None = None,
                 adaptive: AdaptivePolicy | None = None, **engine: int) -> ServeConfig:
    """The :class:`ServeConfig` a configuration ``name`` stands for, with ``engine`` fields
    (``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``), the SLO an adaptive
    configuration watches and its rebalancer's policy (``adaptive``; default thresholds
    when None); :class:`ConfigError` for a name outside the grammar."""
    if not isinstance(name, str):
        raise TypeError(f"a configuration name is a str, got {type(name).__name__}")
    if adaptive is not None and not isinstance(adaptive, AdaptivePolicy):
        raise TypeError(f"adaptive is an AdaptivePolicy, got {type(adaptive).__name__}")
    kind, _, rest = name.strip().partition(":")
    kind = kind.lower()
    try:
        if kind == "colocated":
            if not rest.isdigit() or int(rest) < 1:
                raise ConfigError(f"{name!r}: colocated:N wants N >= 1 workers")
            return ServeConfig(num_prefill=0, num_decode=0, num_colocated=int(rest), **engine)
        split = _SPLIT.fullmatch(rest if rest else kind)
        if split is None or (rest and kind not in ("conditional", "adaptive")):
            raise ConfigError(f"unknown configuration {name!r}: want colocated:N, xPyD, "
                              "conditional:xPyD or adaptive:xPyD (e.g. 2P6D)")
        num_prefill, num_decode = int(split.group(1)), int(split.group(2))
        if num_prefill < 1 or num_decode < 1:
            raise ConfigError(f"{name!r}: a split needs >= 1 prefill and >= 1 decode worker")
        if kind == "conditional":
            return ServeConfig(num_prefill=num_prefill, num_decode=num_decode,
                               local_prefill_tokens=LOCAL_PREFILL_TOKENS,
                               local_prefill_queue=LOCAL_PREFILL_QUEUE, **engine)
        if kind == "adaptive":
            return ServeConfig(num_prefill=num_prefill, num_decode=num_decode,
                               adaptive=adaptive or AdaptivePolicy(), adaptive_slo_ms=slo_ms,
                               **engine)
        return ServeConfig(num_prefill=num_prefill, num_decode=num_decode, **engine)
    except ConfigError:
        raise
    except ValueError as exc:  # ServeConfig's own checks (e.g. adaptive needs 3 workers)
        raise ConfigError(f"{name!r}: {exc}") from None


def split_of(name: str) -> tuple[int, int] | None:
    """``(x, y)`` of a static split's name ``xPyD``; None for any other name."""
    split = _SPLIT.fullmatch(name.strip()) if isinstance(name, str) else None
    return None if split is None else (int(split.group(1)), int(split.group(2)))


def configs_for(num_gpus: int) -> list[str]:
    """Every configuration of ``num_gpus`` workers: colocated, each xPyD split, and its
    conditional and adaptive variants (adaptive from 3 workers on)."""
    if type(num_gpus) is not int or num_gpus < 1:
        raise ValueError(f"--gpus wants an int >= 1, got {num_gpus!r}")
    names = [f"colocated:{num_gpus}"]
    splits = [f"{x}P{num_gpus - x}D" for x in range(1, num_gpus)]
    names += splits + [f"conditional:{s}" for s in splits]
    if num_gpus >= 3:
        names += [f"adaptive:{s}" for s in splits]
    return names
