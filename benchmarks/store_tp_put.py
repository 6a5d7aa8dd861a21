"""Put throughput of a TP group (each rank puts its part) against a tp=1 put, one host.

One store node in its own process (2 MiB slots); a Llama-3-8B-shaped pool (32 layers,
8 kv heads, head_dim 128, bf16, 16-token blocks: 2 MiB objects). Per case, ``--iters``
puts of ``--batch`` objects under fresh keys; a TP case times both ranks' puts (two
clients, one after the other), i.e. whole objects. The memcpy limit is the same bytes
copied by one thread in the same run. Each timed put is checked complete (lookup).

    PYTHONPATH=$PWD python benchmarks/store_tp_put.py [--json benchmarks/results/store_tp_put.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import kvxfer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from store_cases import SECRET, start_node, stop_node  # noqa: E402

L, H, D, B = 32, 8, 128, 16


def pool(dims: str, num_blocks: int, tp_rank: int = 0, tp_size: int = 1):
    h = H // tp_size
    shape = (num_blocks, 2, B, h, D) if dims == "N 2 B H D" else (num_blocks, 2, h, B, D)
    g = torch.Generator().manual_seed(tp_rank)
    tensors = [torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
               for _ in range(L)]
    return kvxfer.KVLayout.from_tensors(tensors, dims, tp_rank=tp_rank, tp_size=tp_size)


def memcpy_gbs(nbytes: int, reps: int = 7) -> float:
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b.copy_(a)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="objects per put call")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    proc, addr = start_node(capacity="1G", slot="2M")
    out = {"load_avg_start": os.getloadavg()[0], "batch": args.batch, "iters": args.iters, "cases": {}}
    try:
        with kvxfer.KVStore(nodes=[addr], secret=SECRET) as s0, kvxfer.KVStore(nodes=[addr], secret=SECRET) as s1:
            n = args.batch
            full = pool("N 2 B H D", n)
            nhd = [pool("N 2 B H D", n, r, 2) for r in range(2)]
            hnd = [pool("N 2 H B D", n, r, 2) for r in range(2)]
            obj_bytes = full.wire_nbytes(1)
            cases = {
                "tp1_nhd_whole": [(s0, full)],
                "tp2_nhd_parts_straight": [(s0, nhd[0]), (s1, nhd[1])],
                "tp2_nhd_parts_staging": [(s0, nhd[0]), (s1, nhd[1])],
                "tp2_hnd_parts_staging": [(s0, hnd[0]), (s1, hnd[1])],
            }
            samples: dict = {name: [] for name in cases}
            memcpy = []
            seq = 0
            for it in range(args.iters + 1):  # round-robin over the cases; the first round warms up
                for name, puts in cases.items():
                    for st, layout in puts:
                        st._format(layout).put_zero_copy = "straight" in name or "whole" in name
                    seq += 1
                    keys = kvxfer.block_keys(range(n * B), B, salt=b"tp-bench-%d" % seq)
                    t = time.perf_counter()
                    for st, layout in puts:
                        st.put(keys, layout, range(n)).wait(timeout=120)
                    dt = time.perf_counter() - t
                    if s0.lookup(keys) != n:
                        raise SystemExit(f"{name}: objects incomplete after the put")
                    if it:
                        samples[name].append(n * obj_bytes / dt / 1e9)
                memcpy.append(memcpy_gbs(n * obj_bytes))
            limit = statistics.median(memcpy)
            out["memcpy_gbs"] = limit
            for name, gbs in samples.items():
                med = statistics.median(gbs)
                out["cases"][name] = {"gbs_median": med, "ratio_to_memcpy": med / limit, "samples": gbs}
                print(f"{name:26s} {med:6.2f} GB/s  {med / limit:5.2f}x memcpy", flush=True)
            print(f"{'memcpy limit':26s} {limit:6.2f} GB/s")
    finally:
        stop_node(proc)
    out["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
