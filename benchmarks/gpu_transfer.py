"""Two-process agent transfer on one device, bitwise, with its rate against a same-run copy.

``python benchmarks/gpu_transfer.py --device cuda --json OUT.json`` starts a
receiver process (D), then sends from this one (P): a Llama-3-8B request of
``--tokens`` tokens (vLLM per-layer ``[2, N, B, H, D]`` bf16 pools on both sides),
``--reps`` times per path (zero-copy, then pack), and compares the median rate
with a device-to-device ``copy_`` of the same bytes (CUDA events; on CPU a
contiguous ``copy_``). D checks every phase bitwise: it rebuilds P's pool from
the same seed and compares the received blocks with it.
``--device cpu`` runs the same code on host pools (the plumbing check).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SECRET = b"kvxfer-gpu-check-shared-secret-32"
MODELS = {"Llama-3-8B": (32, 8, 128, 16), "SmolLM2-135M": (30, 3, 64, 16)}  # layers, heads, head dim, block


def make_layout(model: str, blocks: int, device: str, seed: int | None):
    """Per-layer ``[2, N, B, H, D]`` bf16 pools; random bytes from ``seed`` (zeros if None)."""
    import torch

    from kvxfer import KVLayout

    layers, heads, head_dim, block = MODELS[model]
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    tensors = []
    for _ in range(layers):
        if seed is None:
            raw = torch.zeros(2, blocks, block, heads, head_dim * 2, dtype=torch.uint8, device=device)
        else:
            raw = torch.randint(0, 256, (2, blocks, block, heads, head_dim * 2), dtype=torch.uint8,
                                device=device, generator=g)
        tensors.append(raw.view(torch.bfloat16))
    return KVLayout.vllm(tensors)


def ids_for(blocks_needed: int, pool_blocks: int, seed: int) -> list:
    import numpy as np

    return np.random.default_rng(seed).choice(pool_blocks, blocks_needed, replace=False).tolist()


def receiver(args) -> int:
    """D: post recvs phase by phase, verify each phase bitwise, report JSON lines on stdout."""
    import torch

    import kvxfer
    from kvxfer import Agent, AgentConfig

    dst = make_layout(args.model, args.pool_blocks, args.device, None)
    src = make_layout(args.model, args.pool_blocks, args.device, args.seed)  # P's bytes, for checking
    n = args.tokens // MODELS[args.model][3]
    src_ids, dst_ids = ids_for(n, args.pool_blocks, 1), ids_for(n, args.pool_blocks, 2)
    want = kvxfer.pack(src, src_ids, backend="reference")
    with Agent("d", secret=SECRET, backend=args.backend,
               config=AgentConfig.from_env(staging_bytes=args.staging_mib << 20)) as agent:
        agent.register_kv(dst)
        print(json.dumps({"address": agent.address}), flush=True)
        for phase in args.phases.split(","):
            handles = []
            for i in range(args.reps + 2):  # one at a time: a pending recv holds dst_ids (BlocksBusy)
                handles.append(agent.recv(f"{phase}-{i}", dst_ids, timeout=120.0))
                handles[-1].wait(120.0)
            if dst.device.type == "cuda":
                torch.cuda.synchronize(dst.device)
            ok = torch.equal(kvxfer.pack(dst, dst_ids, backend="reference"), want)
            print(json.dumps({"phase": phase, "bitwise": ok, "path": handles[-1].path,
                              "metrics": agent.metrics.to_dict()}), flush=True)
            for t in dst.tensors:
                t.zero_()
    return 0


def copy_seconds(nbytes: int, device: str, reps: int) -> list:
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    out = []
    for _ in range(reps + 2):
        if device == "cpu":
            t0 = time.perf_counter()
            b.copy_(a)
            out.append(time.perf_counter() - t0)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
    return out[2:]


def read_json(stream) -> dict:
    """The next JSON object line of ``stream`` (lines UCX's own logging prints there are skipped)."""
    for line in stream:
        if line.startswith("{"):
            return json.loads(line)
        print(line, end="", file=sys.stderr)
    raise RuntimeError("the receiver exited before reporting")


def sender(args) -> int:
    from kvxfer import Agent, AgentConfig

    child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--role", "d"], stdout=subprocess.PIPE,
                             text=True)
    try:
        address = read_json(child.stdout)["address"]
        src = make_layout(args.model, args.pool_blocks, args.device, args.seed)
        n = args.tokens // MODELS[args.model][3]
        src_ids = ids_for(n, args.pool_blocks, 1)
        nbytes = src.wire_nbytes(n)
        result = {"model": args.model, "tokens": args.tokens, "bytes": nbytes, "device": args.device,
                  "load_avg": os.getloadavg()[0], "phases": []}
        copy = copy_seconds(nbytes, args.device, args.reps)
        result["copy_gbps"] = nbytes / statistics.median(copy) / 1e9
        for phase in args.phases.split(","):
            path = "pack" if phase == "pack" else "zero_copy"
            with Agent(f"p-{phase}", secret=SECRET, backend=args.backend,
                       config=AgentConfig.from_env(path=path, staging_bytes=args.staging_mib << 20)) as agent:
                agent.register_kv(src)
                peer = agent.connect(address)
                times = []
                for i in range(args.reps + 2):
                    t0 = time.perf_counter()
                    h = agent.send(peer, f"{phase}-{i}", src_ids)
                    h.wait(120.0)
                    times.append(time.perf_counter() - t0)
                check = read_json(child.stdout)
                gbps = nbytes / statistics.median(times[2:]) / 1e9
                result["phases"].append({"phase": phase, "path": h.path, "transport": peer.device_transport
                                         if args.device == "cuda" else peer.transport,
                                         "host_lane": peer.transport,
                                         "ucx_info": getattr(peer.bconn, "ucx_info", ""),
                                         "sender_metrics": agent.metrics.to_dict(),
                                         "receiver_metrics": check.get("metrics"),
                                         "gbps": gbps, "ratio_to_copy": gbps / result["copy_gbps"],
                                         "median_ms": statistics.median(times[2:]) * 1e3,
                                         "bitwise": check["bitwise"], "recv_path": check["path"]})
        child.wait(60)
        result["ok"] = child.returncode == 0 and all(p["bitwise"] for p in result["phases"])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if result["ok"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["p", "d"], default="p")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="Llama-3-8B")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--pool-blocks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phases", default="zero_copy,pack")
    ap.add_argument("--backend", default="ucx")
    ap.add_argument("--staging-mib", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    return receiver(args) if args.role == "d" else sender(args)


if __name__ == "__main__":
    sys.exit(main())
