"""Attention's cost from a model's shape and a GPU's published peaks, at efficiencies
fitted to DistServe's measured OPT fits.

Two terms of the cost model (:mod:`kvxfer.serving.simulated.cost_model`) are attention:

- **decode reads the KV**: a decode step reads every context token's K and V from HBM,
  ``kv_bytes_per_token`` a token (all layers), spread over the ``tp`` GPUs of a worker:
  ``e_decode_context = kv_bytes_per_token / (tp * hbm_bytes_per_s * eta_mem)``;
- **a prompt chunk's attention** does ``4 * n * (p + n/2) * d_model * layers`` FLOPs for
  ``n`` tokens over a prefix of ``p`` (QK^T and PV, two FLOPs a multiply-add, causal):
  ``c_prefill_attention = 4 * d_model * layers / (tp * flops * eta_flop)`` in the
  ``"causal"`` form ``n * (p + n/2)``.

:func:`fit_efficiencies` fits ``eta_mem`` and ``eta_flop`` to DistServe's published
A100-80GB fits of OPT-13B and OPT-66B (its own engine, every tensor-parallel degree):
each DistServe decode ``b`` (both batch fits) is a measured ``e_decode_context``, each
prefill ``c`` a measured ``c * l^2``; an efficiency is the geometric mean of ideal over
measured (least squares in log space). :data:`GPUS`: the peaks, from NVIDIA's data sheets.
"""
from __future__ import annotations

import json
import math
from typing import NamedTuple

from .distserve import MODEL_SHAPES


class GPU(NamedTuple):
    """A GPU's published peaks: HBM bandwidth and dense fp16/bf16 tensor FLOP rate."""

    name: str
    hbm_bytes_per_s: float
    flops: float
    memory_bytes: int


GIB = 1 << 30
GPUS = {  # NVIDIA A100 (80GB SXM) and H100 (SXM5) data sheets
    "a100": GPU("NVIDIA A100-80GB SXM", 2039e9, 312e12, 80 * GIB),
    "h100": GPU("NVIDIA H100-80GB SXM", 3350e9, 989e12, 80 * GIB),
}


class Efficiencies(NamedTuple):
    eta_mem: float  # achieved / peak HBM bandwidth reading KV in decode
    eta_flop: float  # achieved / peak FLOP rate of prefill attention
    errors: dict  # per fit: predicted / DistServe's, for the record


def decode_context_seconds(kv_bytes_per_token: int, gpu: GPU, tp: int, eta_mem: float) -> float:
    """``e_decode_context``: seconds a decode step spends per context token."""
    return kv_bytes_per_token / (tp * gpu.hbm_bytes_per_s * eta_mem)


def prefill_attention_seconds(d_model: int, layers: int, gpu: GPU, tp: int, eta_flop: float) -> float:
    """``c_prefill_attention`` in the causal form: seconds per token pair ``n * (p + n/2)``."""
    return 4 * d_model * layers / (tp * gpu.flops * eta_flop)


def fit_efficiencies(fits_path: str, gpu: GPU = GPUS["a100"]) -> Efficiencies:
    """``eta_mem`` and ``eta_flop`` fitted to a DistServe profiler file's OPT models
    (module docstring), with each fit's predicted / published ratio."""
    with open(fits_path) as f:
        fits = json.load(f)
    mem, flop = [], []
    for model, (layers, d_model) in MODEL_SHAPES.items():
        kv = 2 * layers * d_model * 2
        for tp, entry in fits.get(model, {}).items():
            for which in ("decoding_smallbs", "decoding_largebs"):
                ideal = decode_context_seconds(kv, gpu, int(tp), 1.0)
                mem.append((f"{model} TP {tp} {which} b", ideal, entry[which][1] / 1e3))
            ideal = prefill_attention_seconds(d_model, layers, gpu, int(tp), 1.0) / 2  # per l^2
            flop.append((f"{model} TP {tp} prefill c", ideal, entry["prefill"][2] / 1e3))

    def geo(points):
        return math.exp(sum(math.log(ideal / got) for _, ideal, got in points) / len(points))

    eta_mem, eta_flop = geo(mem), geo(flop)
    errors = {what: ideal / eta / got for eta, points in ((eta_mem, mem), (eta_flop, flop))
              for what, ideal, got in points}
    return Efficiencies(eta_mem, eta_flop, errors)


def kv_capacity_tokens(weights_bytes: int, kv_bytes_per_token: int, gpu: GPU, tp: int,
                       utilization: float = 0.9, activation_bytes: int = 2 * GIB) -> int:
    """KV tokens a worker of ``tp`` GPUs holds: ``utilization`` of their memory, less the
    weights and ``activation_bytes`` a GPU for activations (vLLM's default utilization)."""
    free = tp * (gpu.memory_bytes * utilization - activation_bytes) - weights_bytes
    if free <= 0:
        raise ValueError(f"{weights_bytes} B of weights leave no KV room on {tp} x {gpu.name}")
    return int(free // kv_bytes_per_token)
