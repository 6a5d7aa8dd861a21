"""The disaggregation claim at scale, on the virtual clock: 8, 16 and 32 simulated GPUs.

    python benchmarks/diagnostics/vclock_scale.py --out /tmp/vclock_scale.json

For each cluster size N it gives the Mooncake conversation trace (the first
``--per-gpu`` x N requests) to ``kvxfer plan`` (its pruned search of every configuration
of at most N GPUs, each at the highest rate it serves within the SLO) with least-loaded
and with KV-aware routing, each with the KV store off and on, and reports, per size,
routing and store, the capacity per GPU of the best colocated configuration, the best
static xPyD split, the best conditional and the best adaptive one. SLO: DistServe (OSDI'24) Table 1, chatbot on OPT-66B: TTFT 2.5 s,
TPOT 0.15 s (its 13B row, 0.25 s, is below the modelled prefill time of the trace's
median prompt on one H100). The store (``--store``): one node per 8 GPUs (a host),
each of ``--store-blocks`` one-block slots (default 131,072: 1 TiB of 8 MiB blocks, half
of a DGX H100's 2 TB of system memory), used by the prefill workers as ``kvxfer serve
--store``'s are (colocated workers have none: their figures are the same either way).
Every figure is virtual time: the machine's load does not change it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
TRACE = os.path.join(ROOT, "benchmarks", "traces", "mooncake_conversation_trace.jsonl")
SLO = "2500,150"


def _classes(rows: list[dict]) -> dict:
    """The best configuration of each kind by capacity per GPU (``kvxfer plan``'s rows)."""
    def best(pred):
        cands = [r for r in rows if pred(r["name"]) and r["per_gpu_rate_rps"] is not None]
        return max(cands, key=lambda r: r["per_gpu_rate_rps"]) if cands else None

    out = {"colocated": best(lambda n: n.startswith("colocated")),
           "static": best(lambda n: n[0].isdigit()),
           "conditional": best(lambda n: n.startswith("conditional")),
           "adaptive": best(lambda n: n.startswith("adaptive"))}
    return {k: None if r is None else {"name": r["name"], "gpus": r["gpus"],
                                       "max_rate_rps": r["max_rate_rps"],
                                       "per_gpu_rate_rps": r["per_gpu_rate_rps"]}
            for k, r in out.items()}


def write_doc(path: str | None, doc: dict) -> None:
    """``doc`` as indented JSON to ``path`` (nothing when None); the vclock benchmarks' output."""
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--per-gpu", type=int, default=25, help="requests per GPU in the slice")
    ap.add_argument("--tp", default="1", help="kvxfer plan --tp")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks of 16 tokens per worker (default: the profile's capacity)")
    ap.add_argument("--store-blocks", type=int, default=131072,
                    help="one-block slots of each store node (one node per 8 GPUs)")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--profile", default="h100-llama2-7b-vidur")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    began = time.perf_counter()
    for n in (int(x) for x in args.sizes.split(",")):
        for routing, store in ((r, s) for s in (None, f"{max(1, n // 8)}x{args.store_blocks}")
                               for r in ("least-loaded", "kv")):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "plan.json")
                cmd = [sys.executable, "-m", "kvxfer.cli", "plan", "--trace", args.trace,
                       "--profile", args.profile, "--slo", SLO, "--gpus", str(n),
                       "--max-requests", str(args.per_gpu * n), "--tp", args.tp,
                       "--routing", routing, "--variants", "1", "--jobs", str(args.jobs),
                       "--json", path]
                cmd += ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
                cmd += ["--store", store] if store else []
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": ROOT})
                with open(path) as f:
                    doc = json.load(f)
            row = {"gpus": n, "routing": routing, "store": store or "off", "num_requests": doc["num_requests"],
                   "best": doc["best"], "best_per_gpu_rate_rps": doc["best_per_gpu_rate_rps"],
                   "runs": doc["runs"], "plan_s": time.perf_counter() - t0,
                   **_classes(doc["configs"])}
            results.append(row)
            print(f"{n:>3} GPUs {routing:>12} store {row['store']}: best {row['best']}; "
                  + ", ".join(f"{k} {row[k]['name']} {row[k]['per_gpu_rate_rps']:.3f}/GPU"
                              for k in ("colocated", "static", "conditional", "adaptive")
                              if row[k]), flush=True)
    doc = {"command": "python benchmarks/vclock_scale.py " + " ".join(sys.argv[1:]),
           "slo": SLO, "slo_source": "DistServe (OSDI'24) Table 1, chatbot, OPT-66B",
           "profile": args.profile, "num_blocks": args.num_blocks, "tp": args.tp,
           "store_blocks_per_node": args.store_blocks,
           "elapsed_s": time.perf_counter() - began, "results": results}
    write_doc(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
