"""Cluster configuration names of the virtual clock, parsed into :class:`ServeConfig`.

Grammar (case-insensitive), each with an optional tensor-parallel suffix (none: TP 1):

- ``colocated:N`` or ``colocated:N@K``: N colocated workers (of TP K), chunked prefill
  (``--colocated N``);
- ``xPyD`` (e.g. ``2P6D``), ``xPyD@A`` or ``xPyD@A,B``: x prefill workers (of TP A) and
  y decode workers (of TP B; ``@A`` gives both A) (``--prefill x --decode y``);
- ``conditional:xPyD[@A[,B]]``: xPyD with conditional disaggregation, a prompt prefilled
  on its decode worker when its uncached part is under ``LOCAL_PREFILL_TOKENS`` tokens
  or the prefill worker holds ``LOCAL_PREFILL_QUEUE`` requests (``--local-prefill-tokens``,
  ``--local-prefill-queue``);
- ``adaptive:xPyD[@A[,B]]``: xPyD to start with, workers moved between the roles by the
  rebalancer's policy (``--adaptive``, default thresholds); a moved worker keeps its TP.

A worker of TP K counts as K GPUs (:func:`gpus_of`). :func:`canonical` writes a name
the one way :func:`parse_config` reads it; :func:`configs_for` lists every
configuration of N workers (TP 1), :func:`placements` every static one that fits in
N GPUs with the given TP degrees: what ``kvxfer plan`` searches.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from ..errors import KVXferError
from ..serving.server.adaptive_policy import AdaptivePolicy
from ..serving.server.serve_config import ServeConfig

LOCAL_PREFILL_TOKENS = 1024  # two Mooncake hash blocks
LOCAL_PREFILL_QUEUE = 4
KINDS = ("colocated", "static", "conditional", "adaptive")
FORMS = "colocated:N[@K], xPyD[@A[,B]], conditional:xPyD[@A[,B]] or adaptive:xPyD[@A[,B]]"

_SPLIT = re.compile(r"(\d+)P(\d+)D(?:@(\d+)(?:,(\d+))?)?", re.IGNORECASE)
_COLOCATED = re.compile(r"(\d+)(?:@(\d+))?")


class ConfigError(KVXferError, ValueError):
    """A cluster configuration name that the grammar (module docstring) does not accept."""


class Layout(NamedTuple):
    """What a name says: its kind (:data:`KINDS`), worker counts and TP degrees
    (``num_prefill``/``prefill_tp`` hold the colocated workers' for ``colocated``)."""

    kind: str
    num_prefill: int
    num_decode: int
    prefill_tp: int
    decode_tp: int

    @property
    def gpus(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp


def layout_of(name: str) -> Layout:
    """The :class:`Layout` of a configuration name; :class:`ConfigError` outside the grammar."""
    if not isinstance(name, str):
        raise TypeError(f"a configuration name is a str, got {type(name).__name__}")
    kind, _, rest = name.strip().partition(":")
    kind = kind.lower()
    if kind == "colocated":
        m = _COLOCATED.fullmatch(rest)
        if m is None or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
            raise ConfigError(f"{name!r}: colocated:N[@K] wants N >= 1 workers of TP K >= 1")
        tp = int(m.group(2) or 1)
        return Layout("colocated", int(m.group(1)), 0, tp, tp)
    split = _SPLIT.fullmatch(rest if rest else kind)
    if split is None or (rest and kind not in ("conditional", "adaptive")):
        raise ConfigError(f"unknown configuration {name!r}: want {FORMS} (e.g. 2P6D, 1P1D@2,1)")
    x, y, a, b = split.groups()
    num_prefill, num_decode = int(x), int(y)
    prefill_tp = int(a or 1)
    decode_tp = int(b or prefill_tp)
    if num_prefill < 1 or num_decode < 1:
        raise ConfigError(f"{name!r}: a split needs >= 1 prefill and >= 1 decode worker")
    if prefill_tp < 1 or decode_tp < 1:
        raise ConfigError(f"{name!r}: tensor-parallel degrees are >= 1")
    return Layout(kind if rest else "static", num_prefill, num_decode, prefill_tp, decode_tp)


def gpus_of(name: str) -> int:
    """GPUs a configuration takes: a worker of TP K counts K."""
    return layout_of(name).gpus


def canonical(name: str) -> str:
    """``name`` written as the grammar's one spelling: TP suffix only where not 1, ``@A``
    where both pools have A (``2p6d@1,1`` -> ``2P6D``, ``1P1D@2,2`` -> ``1P1D@2``)."""
    lay = layout_of(name)
    if lay.kind == "colocated":
        return f"colocated:{lay.num_prefill}" + (f"@{lay.prefill_tp}" if lay.prefill_tp != 1 else "")
    split = f"{lay.num_prefill}P{lay.num_decode}D"
    if (lay.prefill_tp, lay.decode_tp) != (1, 1):
        split += (f"@{lay.prefill_tp}" if lay.prefill_tp == lay.decode_tp
                  else f"@{lay.prefill_tp},{lay.decode_tp}")
    return split if lay.kind == "static" else f"{lay.kind}:{split}"


def parse_config(name: str, *, slo_ms: tuple[float, float] | None = None,
                 adaptive: AdaptivePolicy | None = None, **engine) -> ServeConfig:
    """The :class:`ServeConfig` a configuration ``name`` stands for, with ``engine`` fields
    (``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``, ``schedule``), the SLO
    an adaptive configuration watches and its rebalancer's policy (``adaptive``; default
    thresholds when None); :class:`ConfigError` for a name outside the grammar."""
    if adaptive is not None and not isinstance(adaptive, AdaptivePolicy):
        raise TypeError(f"adaptive is an AdaptivePolicy, got {type(adaptive).__name__}")
    lay = layout_of(name)
    try:
        if lay.kind == "colocated":
            return ServeConfig(num_prefill=0, num_decode=0, num_colocated=lay.num_prefill,
                               tp_degrees=(lay.prefill_tp,), **engine)
        tps = (lay.prefill_tp,) * lay.num_prefill + (lay.decode_tp,) * lay.num_decode
        split = dict(num_prefill=lay.num_prefill, num_decode=lay.num_decode, tp_degrees=tps)
        if lay.kind == "conditional":
            return ServeConfig(**split, local_prefill_tokens=LOCAL_PREFILL_TOKENS,
                               local_prefill_queue=LOCAL_PREFILL_QUEUE, **engine)
        if lay.kind == "adaptive":
            return ServeConfig(**split, adaptive=adaptive or AdaptivePolicy(), adaptive_slo_ms=slo_ms,
                               **engine)
        return ServeConfig(**split, **engine)
    except ValueError as exc:  # ServeConfig's own checks (e.g. adaptive needs 3 workers)
        raise ConfigError(f"{name!r}: {exc}") from None


def split_of(name: str) -> tuple[int, int] | None:
    """``(x, y)`` of a static split's name ``xPyD[@A[,B]]``; None for any other name."""
    try:
        lay = layout_of(name)
    except (ConfigError, TypeError):
        return None
    return (lay.num_prefill, lay.num_decode) if lay.kind == "static" else None


def configs_for(num_gpus: int) -> list[str]:
    """Every configuration of ``num_gpus`` workers of TP 1: colocated, each xPyD split, and
    its conditional and adaptive variants (adaptive from 3 workers on)."""
    if type(num_gpus) is not int or num_gpus < 1:
        raise ValueError(f"--gpus wants an int >= 1, got {num_gpus!r}")
    names = [f"colocated:{num_gpus}"]
    splits = [f"{x}P{num_gpus - x}D" for x in range(1, num_gpus)]
    names += splits + [f"conditional:{s}" for s in splits]
    if num_gpus >= 3:
        names += [f"adaptive:{s}" for s in splits]
    return names


def placements(num_gpus: int, tps=(1,), modes=("colocated", "split")) -> list[str]:
    """Every colocated configuration and static split whose workers, of the TP degrees
    ``tps``, take at most ``num_gpus`` GPUs (``modes`` picks the two families)."""
    if type(num_gpus) is not int or num_gpus < 1:
        raise ValueError(f"--gpus wants an int >= 1, got {num_gpus!r}")
    tps = sorted(set(tps))
    names = []
    if "colocated" in modes:
        names += [canonical(f"colocated:{n}@{k}") for k in tps for n in range(1, num_gpus // k + 1)]
    if "split" in modes:
        names += [canonical(f"{x}P{y}D@{a},{b}") for a in tps for b in tps
                  for x in range(1, num_gpus // a + 1) for y in range(1, num_gpus // b + 1)
                  if x * a + y * b <= num_gpus]
    return names
