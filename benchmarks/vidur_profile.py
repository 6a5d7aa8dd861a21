"""Build a GPU cost profile from Vidur's published measurements (microsoft/vidur, MIT),
with attention from the model's shape at efficiencies fitted to DistServe's OPT fits.

    python benchmarks/vidur_profile.py --vidur /work/.mirror/microsoft+vidur/repo \
        --gpu h100 --out kvxfer/serving/simulated/profiles/h100-llama2-7b-vidur.json
    python benchmarks/vidur_profile.py --vidur /work/.mirror/microsoft+vidur/repo \
        --gpu a100 --model llama3-8b --out kvxfer/serving/simulated/profiles/a100-llama3-8b-vidur.json

Reads, from the Vidur repository (a git directory, at its HEAD):

- ``data/profiling/compute/<gpu>/meta-llama/<model>/mlp.csv`` (``Llama-2-7b-hf`` on
  both GPUs; ``Meta-Llama-3-8B`` on the A100 only, the snapshot has no H100 file): for
  each tensor-parallel degree K (``num_tensor_parallel_workers``: 1, 2, 4, 8), per row,
  the step's non-attention time on one of the K GPUs = 32 layers x (the ``.median`` of
  ``input_layernorm``, ``attn_pre_proj``, ``attn_rope``, ``attn_post_proj``,
  ``post_attention_layernorm``, ``mlp_up_proj``, ``mlp_act``, ``mlp_down_proj``,
  ``add``) + ``emb`` (ms, for ``num_tokens`` tokens); for K > 1 plus two all-reduces a
  layer (after the attention and the MLP) of ``num_tokens x 4096 x 2`` bytes, their
  time ``latency + size/bandwidth`` fitted to ``network/<gpu>_dgx/all_reduce.csv`` (K
  workers on one node). A row becomes a prefill point (one chunk of ``num_tokens``)
  and, where ``num_tokens <= 256``, a decode point (a batch of ``num_tokens``
  one-token chunks at context 1): linear layers cost the same per token. Each degree's
  points are fitted (``e_decode_context`` held at 0: the points have no attention).
- ``network/<gpu>_dgx/send_recv.csv``: the link across nodes (``devices_per_node == 1``)
  and within one (``== 2``, NVLink), ``latency + size/bandwidth`` fitted to the medians.

``attention.csv`` is not in the snapshot, so attention comes from the model's shape
(:mod:`kvxfer.sim.attention`): ``e_decode_context`` is the KV bytes a context token
reads from HBM, ``c_prefill_attention`` (causal form) the attention FLOPs of a token
pair, at the GPU's published peaks and the efficiencies fitted to DistServe's A100 OPT
fits (``eta_mem``, ``eta_flop``), added to the fitted linear-ops terms. The KV capacity
of a worker of degree K is :func:`kvxfer.sim.attention.kv_capacity_tokens` (0.9 of K x
80 GiB, less the weights and 2 GiB a GPU).
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess

import numpy as np

from kvxfer.sim.attention import (GPUS, decode_context_seconds, fit_efficiencies,
                                  kv_capacity_tokens, prefill_attention_seconds)
from kvxfer.serving.simulated.cost_model import TERMS, StepCostModel
from kvxfer.sim.distserve import DATA_DIR
from kvxfer.serving.simulated.link import Link
from kvxfer.serving.simulated.profile import Profile, residuals

OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
NUM_LAYERS, D_MODEL = 32, 4096  # both models
# --model: (Vidur's directory, the profile's name part, KV heads, parameters); head dim 128, fp16
MODELS = {"llama2-7b": ("Llama-2-7b-hf", "llama2-7b", 32, 6_738_415_616),
          "llama3-8b": ("Meta-Llama-3-8B", "llama3-8b", 8, 8_030_261_248)}
DEGREES = (1, 2, 4, 8)
# the scheduling a simulated worker of these profiles defaults to: vLLM's batch limits
# (256 sequences; 2,048 tokens a step with chunked prefill, 16,384 without), kvxfer's
# own handoff (the decode worker reserves the prompt's blocks first), recompute
ENGINE = {"name": "kvxfer's scheduler with vLLM's batch limits", "modes": ["colocated", "split"],
          "max_num_seqs": 256, "max_num_batched_tokens": 16384, "chunked_prefill_tokens": 2048,
          "handoff": "reserve-first", "preemption": "recompute"}


def kv_bytes_per_token(kv_heads: int) -> int:
    """K and V of every layer for one token: 2 x layers x KV heads x 128 x 2 bytes (fp16)."""
    return 2 * NUM_LAYERS * kv_heads * 128 * 2


def _csv(repo: str, path: str) -> list[dict]:
    text = subprocess.run(["git", "-C", repo, "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout
    return list(csv.DictReader(io.StringIO(text)))


def _commit(repo: str) -> str:
    return subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def _line_fit(rows: list[dict], column: str) -> tuple[float, float]:
    """(seconds per byte, latency s) fitted to ``column``'s medians (ms) against ``size``."""
    size = np.array([float(r["size"]) for r in rows])
    secs = np.array([float(r[column]) / 1e3 for r in rows])
    (per_byte, latency), *_ = np.linalg.lstsq(np.stack([size, np.ones_like(size)], 1), secs,
                                               rcond=None)
    return float(per_byte), float(max(latency, 0.0))


def _link(rows: list[dict], where: str) -> Link:
    per_byte, latency = _line_fit(rows, "time_stats.send_recv.median")
    sizes = [int(r["size"]) for r in rows]
    return Link(1 / per_byte, latency, f"{where}: {len(rows)} rows ({min(sizes)}-{max(sizes)} B), "
                                       f"latency + size/bandwidth fitted to the median")


def _points(rows: list[dict], tp: int, allreduce: tuple[float, float] | None) -> list[dict]:
    points, seen = [], set()
    for row in rows:
        if row["num_tensor_parallel_workers"] != str(tp) or row["num_tokens"] in seen:
            continue
        seen.add(row["num_tokens"])
        n = int(row["num_tokens"])
        sec = (NUM_LAYERS * sum(float(row[f"time_stats.{op}.median"]) for op in OPS)
               + float(row["time_stats.emb.median"])) / 1e3
        if allreduce is not None:  # two a layer, of n tokens' fp16 activations
            per_byte, latency = allreduce
            sec += 2 * NUM_LAYERS * (latency + n * D_MODEL * 2 * per_byte)
        if n > 1:
            points.append({"kind": "prefill", "chunks": [[n, 0]], "seconds": sec})
        if n <= 256:
            points.append({"kind": "decode", "chunks": [[1, 0]] * n, "seconds": sec})
    return points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur", required=True, help="the microsoft/vidur git directory")
    ap.add_argument("--gpu", default="h100", choices=("a100", "h100"))
    ap.add_argument("--model", default="llama2-7b", choices=tuple(MODELS),
                    help="llama2-7b: 32 KV heads (512 KiB a token); llama3-8b: 8 KV heads "
                         "(GQA, 128 KiB a token)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model_dir, model_name, kv_heads, params = MODELS[args.model]
    gpu, kv = GPUS[args.gpu], kv_bytes_per_token(kv_heads)
    eff = fit_efficiencies(f"{DATA_DIR}/profiler-a100-80g.distserve.json")

    mlp_path = f"data/profiling/compute/{args.gpu}/meta-llama/{model_dir}/mlp.csv"
    net_dir = f"data/profiling/network/{args.gpu}_dgx"
    mlp = _csv(args.vidur, mlp_path)
    reduce_rows = _csv(args.vidur, f"{net_dir}/all_reduce.csv")
    send = _csv(args.vidur, f"{net_dir}/send_recv.csv")
    commit = _commit(args.vidur)
    where = f"microsoft/vidur@{commit[:12]} {net_dir}/send_recv.csv"
    link = _link([r for r in send if r["devices_per_node"] == "1"],
                 f"{where}, devices_per_node == 1 (two GPUs on two nodes)")
    node_link = _link([r for r in send if r["devices_per_node"] == "2"],
                      f"{where}, devices_per_node == 2 (two GPUs on one node, NVLink)")
    fits, notes = {}, []
    for tp in DEGREES:
        allreduce = None
        if tp > 1:
            rows = [r for r in reduce_rows
                    if r["num_workers"] == str(tp) and r["devices_per_node"] == str(tp)]
            allreduce = _line_fit(rows, "time_stats.all_reduce.median")
        points = _points(mlp, tp, allreduce)
        linear = StepCostModel.fit([(p["chunks"], p["seconds"]) for p in points],
                                   terms=[t for t in TERMS if t != "e_decode_context"],
                                   attention="causal")
        coefs = list(linear.coefficients)
        coefs[TERMS.index("c_prefill_attention")] += prefill_attention_seconds(
            D_MODEL, NUM_LAYERS, gpu, tp, eff.eta_flop)
        coefs[TERMS.index("e_decode_context")] += decode_context_seconds(kv, gpu, tp, eff.eta_mem)
        res = residuals(linear, points)["all"]
        notes.append(f"TP {tp}: {len(points)} points, linear-ops fit residual median "
                     f"{100 * res['median_abs']:.1f}% / max {100 * res['max_abs']:.1f}%")
        fits[tp] = (StepCostModel(tuple(coefs), "causal"), kv_capacity_tokens(params * 2, kv, gpu, tp),
                    points, linear)
    base_fit, base_cap, base_points, base_linear = fits.pop(1)
    terms = {
        "a_prefill, b_prefill_tokens, a_decode, d_decode_batch": "fitted to the non-attention "
            "ops (and, TP > 1, two all-reduces a layer) of Vidur's mlp.csv",
        "c_prefill_attention": f"the linear ops' fitted curvature + 4 x {D_MODEL} x {NUM_LAYERS} "
            f"FLOPs a token pair / (TP x {gpu.flops / 1e12:g} TFLOP/s x eta_flop "
            f"{eff.eta_flop:.3f}), causal form",
        "e_decode_context": f"{kv} B of KV a context token / (TP x {gpu.hbm_bytes_per_s / 1e9:g} GB/s "
            f"x eta_mem {eff.eta_mem:.3f})",
        "efficiencies": "eta_mem and eta_flop fitted to DistServe's A100-80GB OPT-13B/66B fits "
            "(kvxfer.sim.attention.fit_efficiencies)",
        "kv_capacity_tokens": f"0.9 x TP x 80 GiB - {params * 2 / 1e9:.2f} GB of weights - "
            f"2 GiB a GPU, over {kv} B a token",
        "notes": "; ".join(notes),
    }
    name = f"{args.gpu}-{model_name}-vidur"
    prof = Profile(name=name, hardware=f"{gpu.name} (Vidur's profiling runs)", model=model_dir,
                   dtype="fp16", block_size=16, kv_bytes_per_token=kv, fit=base_fit, link=link,
                   points=tuple(base_points), residuals=residuals(base_linear, base_points),
                   source=(f"microsoft/vidur@{commit} {mlp_path} (non-attention ops, tensor "
                           f"parallel {', '.join(map(str, DEGREES))}) and {net_dir}/all_reduce.csv; "
                           f"attention from the model's shape (attention.csv is absent from the "
                           f"snapshot); points and residuals: TP 1, linear ops only"),
                   licence="MIT (Copyright (c) Microsoft Corporation), from microsoft/vidur",
                   command=f"python benchmarks/vidur_profile.py --vidur VIDUR_GIT_DIR "
                           f"--gpu {args.gpu}"
                           + (f" --model {args.model}" if args.model != "llama2-7b" else "")
                           + f" --out {args.out}",
                   kv_capacity_tokens=base_cap,
                   tensor_parallel={tp: (fit, cap) for tp, (fit, cap, _, _) in fits.items()},
                   node_link=node_link, gpus_per_node=8, engine=ENGINE, terms=terms)
    prof.save(args.out)
    print(f"wrote {args.out}: eta_mem {eff.eta_mem:.3f}, eta_flop {eff.eta_flop:.3f}; link "
          f"{link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, NVLink {node_link.bandwidth_bytes_per_s / 1e9:.1f} "
          f"GB/s; " + "; ".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
