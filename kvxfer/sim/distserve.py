"""DistServe's published A100-80GB step-time fits as kvxfer profiles.

DistServe (LLMServe/DistServe, Apache-2.0) publishes, per model and tensor-parallel
degree, the fits its simulator uses (``simdistserve/estimators/profile_data/``): in
milliseconds, a prefill batch of prompts ``l_i`` takes ``a + b*sum(l_i) + c*sum(l_i^2)``
(``"prefill": [a, b, c]``) and a decode step of batch ``bs`` over contexts ``ctx_i``
``a + b*sum(ctx_i) + c*bs`` (``"decoding_smallbs"`` below
``decoding_large_small_bs_threshold``, ``"decoding_largebs"`` from it on); and
``max_num_tokens.csv``, the KV tokens one instance holds per (model, tp, pp).

:func:`profile_from_distserve` maps one model of such a file onto the kvxfer cost
model (:mod:`kvxfer.serving.simulated.cost_model`), every degree it publishes, and records where
each term comes from in the profile's ``terms``:

- ``a_prefill`` = prefill ``a`` + 3 ms, ``b_prefill_tokens`` = prefill ``b`` + 1e-4 ms:
  the per-step overhead DistServe's simulator adds to the fit (``Worker.add_ray_overhead``:
  2 ms + 1e-4 ms a context token; ``get_prefill_time``'s 1 ms pipeline constant at pp 1);
- ``c_prefill_attention`` = 2 x prefill ``c`` in the ``"causal"`` form ``n*(p + n/2)``
  (``c*l^2`` for a whole prompt, as DistServe's);
- ``a_decode`` = decode ``a`` + 2 ms, ``e_decode_context`` = decode ``b`` + 1e-4 ms,
  ``d_decode_batch`` = decode ``c``; the large-batch fit likewise, from its threshold;
- ``a_mixed`` = 0 (neither engine ran mixed steps).

The engines' scheduling (the profile's ``engine``) is as their evaluation ran them:
DistServe's prefill instance batches whole prompts (8,192 tokens at most; it has no
chunked prefill, so its profiles run whole prompts whatever is asked), its decode
instance runs every admitted request each step (1,024 at most), takes a prompt's KV
once prefilled when it has the blocks, and swaps the newest request out when it runs
out (over PCIe, 25 GB/s a GPU); vLLM (early 2024) runs whole prompts first, 16,384
tokens a step, and recomputes the newest request when out of blocks.

A coefficient published negative (vLLM's OPT-66B TP-2 prefill ``c``) is held at 0,
and the profile's ``terms`` say so. Pipeline-parallel degrees > 1 are not imported.
"""
from __future__ import annotations

import csv
import json
import os

from ..serving.simulated.cost_model import StepCostModel
from ..serving.simulated.link import Link
from ..serving.simulated.profile import SHIPPED_DIR, Profile, ProfileError

DATA_DIR = os.path.join(SHIPPED_DIR, "distserve")
SOURCE = ("LLMServe/DistServe@82831f1604cc6b10bebd360f6c437a07790dde9f "
          "simdistserve/estimators/profile_data/")
LICENCE = "Apache-2.0 (LLMServe/DistServe), copied in kvxfer/serving/simulated/profiles/distserve/"
RAY_S, RAY_PER_TOKEN_S, PIPELINE_S = 2e-3, 1e-7, 1e-3  # DistServe simulator's overheads
# (layers, hidden size) of the models DistServe profiles; fp16 KV: 2 x layers x hidden x 2 B
MODEL_SHAPES = {"facebook/opt-13b": (40, 5120), "facebook/opt-66b": (64, 9216),
                "facebook/opt-175b": (96, 12288)}
PCIE_BYTES_PER_S = 25e9  # one A100's PCIe 4.0 x16 to host, of 32 GB/s peak: DistServe's swap
# the engines the two files profile, as their evaluation ran them
# (evaluation/2-benchmark-serving/2-start-api-server.py)
ENGINES = {
    "distserve": {"name": "DistServe (OSDI'24): prefill and decode instances", "modes": ["split"],
                  "max_num_seqs": 1024, "max_num_batched_tokens": 8192,
                  "chunked_prefill": False, "handoff": "after-prefill",
                  "preemption": "swap", "swap_bytes_per_s": PCIE_BYTES_PER_S},
    "vllm": {"name": "vLLM of early 2024 (no chunked prefill)", "modes": ["colocated", "split"],
             "max_num_seqs": 1024, "max_num_batched_tokens": 16384,
             "chunked_prefill_tokens": 2048, "handoff": "reserve-first",
             "preemption": "recompute"},
}
# one A100-80GB SXM's links (Vidur's measurements, the ones a100-*-vidur profiles use)
_VIDUR = "microsoft/vidur@7d47513363ec data/profiling/network/a100_dgx/send_recv.csv"
A100_NETWORK = Link(7.831473102976521e9, 4.2916649518430155e-05,
                    f"{_VIDUR}: 994 rows with devices_per_node == 1 (two GPUs on two nodes, "
                    "2048-67108864 B), latency + size/bandwidth fitted to the median")
A100_NVLINK = Link(234.53110722882417e9, 4.704164031172977e-06,
                   f"{_VIDUR}: 994 rows with devices_per_node == 2 (two GPUs on one node, "
                   "2048-67108864 B), latency + size/bandwidth fitted to the median")


def read_capacity(path: str) -> dict[tuple[str, int], int]:
    """``max_num_tokens.csv``: ``{(model, tp): tokens}`` at pipeline degree 1."""
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if int(row["pp"]) == 1:
                out[(row["model"], int(row["tp"]))] = int(row["max_num_tokens"])
    return out


def _fit(entry: dict, notes: list[str], where: str) -> StepCostModel:
    a, b, c = entry["prefill"]
    if c < 0:
        notes.append(f"{where}: prefill c published as {c!r} ms/token^2, held at 0")
        c = 0.0
    small, large = entry["decoding_smallbs"], entry["decoding_largebs"]

    def decode(fit):
        a_d, b_d, c_d = fit
        return (a_d / 1e3 + RAY_S, c_d / 1e3, b_d / 1e3 + RAY_PER_TOKEN_S)

    coefs = (a / 1e3 + RAY_S + PIPELINE_S, b / 1e3 + RAY_PER_TOKEN_S, 2 * c / 1e3,
             *decode(small), 0.0)
    return StepCostModel(coefs, "causal", decode(large), int(entry["decoding_large_small_bs_threshold"]))


def profile_from_distserve(fits_path: str, model: str, *, capacity_path: str | None = None,
                           engine: str | None = None, name: str | None = None,
                           kv_bytes_per_token: int | None = None) -> Profile:
    """One ``model`` of a DistServe profiler file as a :class:`Profile` (module docstring).

    ``capacity_path``: its ``max_num_tokens.csv`` (default: the one beside ``fits_path``);
    ``engine``: ``"distserve"`` or ``"vllm"`` (default: from the file's name);
    ``kv_bytes_per_token``: needed for a model outside :data:`MODEL_SHAPES`.
    :class:`ProfileError` for anything missing."""
    engine = engine or ("vllm" if "vllm" in os.path.basename(fits_path) else "distserve")
    if engine not in ENGINES:
        raise ProfileError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    capacity_path = capacity_path or os.path.join(os.path.dirname(fits_path), "max_num_tokens.csv")
    try:
        with open(fits_path) as f:
            fits = json.load(f)
        capacity = read_capacity(capacity_path)
    except OSError as exc:
        raise ProfileError(f"cannot read {exc.filename}: {exc.strerror}") from None
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        raise ProfileError(f"{fits_path} or {capacity_path}: malformed ({exc})") from None
    if model not in fits:
        raise ProfileError(f"{fits_path} has no model {model!r}; it has {', '.join(fits)}")
    if kv_bytes_per_token is None:
        if model not in MODEL_SHAPES:
            raise ProfileError(f"no known shape for {model!r}: give kv_bytes_per_token")
        layers, hidden = MODEL_SHAPES[model]
        kv_bytes_per_token = 2 * layers * hidden * 2
    notes: list[str] = []
    degrees = {}
    try:
        for tp, entry in sorted(fits[model].items(), key=lambda kv: int(kv[0])):
            degrees[int(tp)] = (_fit(entry, notes, f"TP {tp}"), capacity.get((model, int(tp))))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{fits_path}: {model}: malformed fit ({exc})") from None
    missing = [k for k, (_, cap) in degrees.items() if cap is None]
    if missing:
        raise ProfileError(f"{capacity_path} has no capacity for {model} at TP {missing} (pp 1)")
    base = min(degrees)
    fit, cap = degrees.pop(base)
    short = model.rsplit("/", 1)[-1].replace("-", "")
    terms = {
        "a_prefill": "DistServe prefill a + 3 ms (its simulator's Ray overhead 2 ms and "
                     "pipeline constant 1 ms a prefill step)",
        "b_prefill_tokens": "DistServe prefill b + 1e-4 ms a token (Ray overhead per token)",
        "c_prefill_attention": "2 x DistServe prefill c: the causal form n*(p + n/2), "
                               "c*l^2 for a whole prompt",
        "a_decode": "DistServe decoding a + 2 ms (Ray overhead a step)",
        "d_decode_batch": "DistServe decoding c (per sequence in the batch)",
        "e_decode_context": "DistServe decoding b + 1e-4 ms (per context token: reading its KV, "
                            "Ray overhead per token)",
        "a_mixed": "0: neither engine ran prefill and decode in one step",
        "large_batch": "DistServe's decoding_largebs fit, the same mapping, from "
                       "decoding_large_small_bs_threshold sequences",
        "kv_capacity_tokens": "max_num_tokens.csv at pp 1 (A100-80GB)",
    }
    if notes:
        terms["notes"] = "; ".join(notes)
    return Profile(
        name=name or f"a100-{short}-{engine}", hardware="NVIDIA A100-80GB SXM (DistServe's runs)",
        model=model, dtype="fp16", block_size=16, kv_bytes_per_token=kv_bytes_per_token,
        fit=fit, link=A100_NETWORK, tp=base, kv_capacity_tokens=cap, tensor_parallel=degrees,
        node_link=A100_NVLINK, gpus_per_node=8, engine=ENGINES[engine], terms=terms,
        source=f"{SOURCE}{os.path.basename(fits_path)} and {os.path.basename(capacity_path)}: "
               f"published fits (no measured points)",
        licence=LICENCE,
        command=f"kvxfer profile --from-distserve {os.path.basename(fits_path)} --model {model}")
