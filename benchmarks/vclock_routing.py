"""KV-aware routing against least-loaded at 16 simulated GPUs on the conversation trace.

    python benchmarks/vclock_routing.py --out benchmarks/results/vclock_routing.json
    python benchmarks/vclock_routing.py --profile a100-llama3-8b-vidur --max-requests 1000 \
        --blocks 28000 --time-scales 0.75,0.5,0.375,0.25 \
        --out benchmarks/results/vclock_routing_llama3.json

For each ``--blocks`` (KV blocks a GPU) and ``--time-scales`` (arrival rate) it replays
the first ``--max-requests`` requests of the Mooncake conversation trace on
``colocated:16`` with ``--routing least-loaded`` and ``--routing kv`` (``kvxfer
simulate``'s :func:`~kvxfer.sim.replay.run_config`, ``--profile``, by default
``h100-llama2-7b-vidur``, SLO 2.5 s / 0.15 s as ``benchmarks/vclock_scale.py``) and reports goodput and the local
prefix-hit ratio two ways: the workers' block managers' (``prefix_hit_ratio``; a
preempted request allocating again counts again) and the router's (``routed_hit_ratio``:
the chosen worker's cached prefix once a request). Beside them, the ceilings of the
slice, whatever the router does: the hit ratio of one LRU prefix cache of the whole
cluster's blocks, and of an unbounded one (the requests run one after another through
a real :class:`~kvxfer.serving.engine.block_manager.BlockManager`). Every figure is
virtual time: the machine's load does not change it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vclock_scale import write_doc  # noqa: E402  (benchmarks/)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "benchmarks", "traces", "mooncake_conversation_1000.jsonl")  # its first 1,000 lines
SLO = "2500,150"
GPUS = 16


def ceiling(requests, num_blocks: int, pool_tokens: int) -> float:
    """The prefix-hit ratio of one LRU cache of ``num_blocks`` blocks, requests one at a
    time (those longer than a worker's pool, ``pool_tokens``, refused as the router does)."""
    from kvxfer.serving.engine.block_manager import BlockManager
    from kvxfer.serving.engine.sequence import Sequence

    bm = BlockManager(num_blocks, 16)
    for _, ids, max_tokens in requests:
        if len(ids) + max_tokens > pool_tokens:
            continue
        seq = Sequence(list(ids))
        bm.allocate(seq)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        bm.deallocate(seq)
    return bm.num_hit_tokens / bm.num_query_tokens


def main() -> int:
    from kvxfer.sim.replay import RunOptions, TraceSlice, run_config
    from kvxfer.loadgen.metrics import SLO as Slo
    from kvxfer.serving.engine.config import EngineConfig
    from kvxfer.serving.simulated.profile import load_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--max-requests", type=int, default=400)
    ap.add_argument("--time-scales", default="0.375,0.25",
                    help="0.375: vclock_scale.py's rate at 16 GPUs; 0.25: 1.5x that")
    ap.add_argument("--blocks", default="6000,24000",
                    help="KV blocks a GPU: 6000 is Llama-2-7B's (8 MiB blocks) on an 80 GB "
                         "H100; 24000 a model with 4x smaller KV (GQA, e.g. 8 KV heads of 32); "
                         "28000 is Llama-3-8B's (2 MiB blocks) on an 80 GiB A100 (--profile "
                         "a100-llama3-8b-vidur): 0.9 x 80 GiB - 15 GiB of weights - ~2 GiB "
                         "of activations = 55 GiB")
    ap.add_argument("--profile", default="h100-llama2-7b-vidur")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    profile, slo = load_profile(args.profile), Slo.parse(SLO)
    began, results, ceilings = time.perf_counter(), [], {}
    for num_blocks in (int(b) for b in args.blocks.split(",")):
        for scale in (float(s) for s in args.time_scales.split(",")):
            requests = TraceSlice(args.trace, start=args.start, max_requests=args.max_requests,
                                  time_scale=scale).arrivals()
            if num_blocks not in ceilings:
                pool = num_blocks * 16
                ceilings[num_blocks] = {"cluster_lru": ceiling(requests, GPUS * num_blocks, pool),
                                        "unbounded": ceiling(requests, 10 ** 7, pool)}
            row = {"num_blocks": num_blocks, "time_scale": scale, "num_requests": len(requests),
                   "rate_rps": len(requests) / requests[-1][0], **{
                       f"ceiling_{k}": v for k, v in ceilings[num_blocks].items()}}
            for routing in ("least-loaded", "kv"):
                options = RunOptions(routing=routing, num_blocks=num_blocks,
                                     max_num_seqs=EngineConfig.max_num_seqs,
                                     max_num_batched_tokens=EngineConfig.max_num_batched_tokens)
                r = run_config(f"colocated:{GPUS}", options, profile, slo, requests)
                row[routing] = {k: r[k] for k in ("goodput_rps", "slo_attainment", "ttft_p50_ms",
                                                  "ttft_p99_ms", "tpot_p99_ms", "prefix_hit_ratio",
                                                  "routed_hit_ratio")}
                row[routing]["preemptions"] = r["counters"].get("preemptions", 0)
            ll, kv = row["least-loaded"], row["kv"]
            row["kv_over_least_loaded"] = {
                "goodput": kv["goodput_rps"] / ll["goodput_rps"],
                "routed_hits": kv["routed_hit_ratio"] / ll["routed_hit_ratio"]}
            results.append(row)
            print(f"{num_blocks} blocks, time scale {scale} ({row['rate_rps']:.1f} req/s): goodput "
                  f"least-loaded {ll['goodput_rps']:.3f}, kv {kv['goodput_rps']:.3f} "
                  f"({row['kv_over_least_loaded']['goodput']:.3f}x); routed hits "
                  f"{100 * ll['routed_hit_ratio']:.2f}% / {100 * kv['routed_hit_ratio']:.2f}% "
                  f"({row['kv_over_least_loaded']['routed_hits']:.2f}x); ceilings: cluster LRU "
                  f"{100 * row['ceiling_cluster_lru']:.2f}%, unbounded "
                  f"{100 * row['ceiling_unbounded']:.2f}%", flush=True)
    doc = {"command": "python benchmarks/vclock_routing.py " + " ".join(sys.argv[1:]),
           "config": f"colocated:{GPUS}", "slo": SLO, "profile": args.profile,
           "start": args.start, "max_requests": args.max_requests,
           "elapsed_s": time.perf_counter() - began, "results": results}
    write_doc(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
