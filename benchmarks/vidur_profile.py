"""Build a GPU cost profile from Vidur's published measurements (microsoft/vidur, MIT).

    python benchmarks/vidur_profile.py --vidur /work/.mirror/microsoft+vidur/repo \
        --gpu h100 --out kvxfer/sim/profiles/h100-llama2-7b-vidur.json
    python benchmarks/vidur_profile.py --vidur /work/.mirror/microsoft+vidur/repo \
        --gpu a100 --model llama3-8b --out kvxfer/sim/profiles/a100-llama3-8b-vidur.json

Reads, from the Vidur repository (a git directory, at its HEAD):

- ``data/profiling/compute/<gpu>/meta-llama/<model>/mlp.csv`` (``Llama-2-7b-hf`` on
  both GPUs; ``Meta-Llama-3-8B`` on the A100 only, the snapshot has no H100 file): rows with
  ``num_tensor_parallel_workers == 1``; per row, the step's non-attention time =
  32 layers x (the ``.median`` of ``input_layernorm``, ``attn_pre_proj``,
  ``attn_rope``, ``attn_post_proj``, ``post_attention_layernorm``,
  ``mlp_up_proj``, ``mlp_act``, ``mlp_down_proj``, ``add``) + ``emb`` (ms, for
  ``num_tokens`` tokens). A row becomes a prefill point (one chunk of
  ``num_tokens``) and, where ``num_tokens <= 256``, also a decode point (a batch of
  ``num_tokens`` one-token chunks at context 1): linear layers cost the same per token.
- ``data/profiling/network/<gpu>_dgx/send_recv.csv``: rows with
  ``devices_per_node == 1`` (two GPUs on two nodes); ``latency + size / bandwidth``
  fitted to ``time_stats.send_recv.median`` (ms) by least squares.

The attention kernels' file (``attention.csv``) is not in the snapshot, so
attention time is not modelled: ``e_decode_context`` is held at 0 and
``c_prefill_attention`` only fits the curvature of the linear ops' time in
``num_tokens``. The profile under-estimates steps whose attention matters
(long contexts, large decode batches). Every number in it comes from those two files.
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess

from kvxfer.sim.cost_model import TERMS, StepCostModel
from kvxfer.sim.link import Link
from kvxfer.sim.profile import Profile, residuals

OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
NUM_LAYERS = 32  # both models
# --model: (Vidur's directory, the profile's name part, KV heads); head dim 128, fp16.
MODELS = {"llama2-7b": ("Llama-2-7b-hf", "llama2-7b", 32),
          "llama3-8b": ("Meta-Llama-3-8B", "llama3-8b", 8)}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur", required=True, help="the microsoft/vidur git directory")
    ap.add_argument("--gpu", default="h100", choices=("a100", "h100"))
    ap.add_argument("--model", default="llama2-7b", choices=tuple(MODELS),
                    help="llama2-7b: 32 KV heads (512 KiB a token); llama3-8b: 8 KV heads "
                         "(GQA, 128 KiB a token)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model_dir, model_name, kv_heads = MODELS[args.model]

    mlp_path = f"data/profiling/compute/{args.gpu}/meta-llama/{model_dir}/mlp.csv"
    net_path = f"data/profiling/network/{args.gpu}_dgx/send_recv.csv"
    points, seen = [], set()
    for row in _csv(args.vidur, mlp_path):
        if row["num_tensor_parallel_workers"] != "1" or row["num_tokens"] in seen:
            continue
        seen.add(row["num_tokens"])
        n = int(row["num_tokens"])
        ms = NUM_LAYERS * sum(float(row[f"time_stats.{op}.median"]) for op in OPS) \
            + float(row["time_stats.emb.median"])
        if n > 1:
            points.append({"kind": "prefill", "chunks": [[n, 0]], "seconds": ms / 1e3})
        if n <= 256:
            points.append({"kind": "decode", "chunks": [[1, 0]] * n, "seconds": ms / 1e3})
    fit = StepCostModel.fit([(p["chunks"], p["seconds"]) for p in points],
                            terms=[t for t in TERMS if t != "e_decode_context"])

    import numpy as np

    net = [r for r in _csv(args.vidur, net_path) if r["devices_per_node"] == "1"]
    size = np.array([float(r["size"]) for r in net])
    secs = np.array([float(r["time_stats.send_recv.median"]) / 1e3 for r in net])
    (per_byte, latency), *_ = np.linalg.lstsq(np.stack([size, np.ones_like(size)], 1), secs,
                                               rcond=None)
    commit = _commit(args.vidur)
    link = Link(float(1 / per_byte), float(max(latency, 0.0)),
                f"microsoft/vidur@{commit[:12]} {net_path}: {len(net)} rows with "
                f"devices_per_node == 1 ({int(size.min())}-{int(size.max())} B), "
                f"latency + size/bandwidth fitted to time_stats.send_recv.median")
    name = f"{args.gpu}-{model_name}-vidur"
    prof = Profile(name=name, hardware=f"NVIDIA {args.gpu.upper()} (Vidur's profiling runs), "
                                       f"tensor parallel 1", model=model_dir, dtype="fp16",
                   block_size=16, kv_bytes_per_token=kv_bytes_per_token(kv_heads), fit=fit, link=link,
                   points=tuple(points), residuals=residuals(fit, points),
                   source=(f"microsoft/vidur@{commit} {mlp_path}: non-attention ops only "
                           f"(32 x median of {', '.join(OPS)}, + emb), tensor parallel 1; "
                           f"attention.csv is absent from the snapshot, so attention time is "
                           f"not modelled (e_decode_context held at 0; c_prefill_attention fits the linear ops' "
                           f"curvature only)"),
                   licence="MIT (Copyright (c) Microsoft Corporation), from microsoft/vidur",
                   command=f"python benchmarks/vidur_profile.py --vidur VIDUR_GIT_DIR "
                           f"--gpu {args.gpu}"
                           + (f" --model {args.model}" if args.model != "llama2-7b" else "")
                           + f" --out {args.out}")
    prof.save(args.out)
    print(f"wrote {args.out}: {len(points)} points; fit {fit.as_dict()}; link "
          f"{link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, {link.latency_s * 1e6:.1f} us; "
          f"residuals {prof.residuals['all']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
