"""Two-process agent transfer on one node, bitwise, with its rate against a same-run copy.

``python benchmarks/gpu/transfer.py --device cuda --json OUT.json`` starts a receiver
process (D), then sends from this one (P): a Llama-3-8B request of ``--tokens`` tokens,
``--reps`` times per phase, and compares the median rate with a device-to-device copy of
the same bytes (CUDA events; on CPU a contiguous ``copy_``) and, where D's pool is on
another GPU (``--d-device cuda:1``), with ``cudaMemcpyPeer`` of the same bytes.

``--layout``: ``per_layer`` (vLLM's ``[2, N, B, H, D]`` bf16 tensor per layer) or
``cross_layer`` (one ``[N, L, 2, B, H, D]`` pool: a block's every layer contiguous).
Phases (``--phases``, each a fresh agent pair):

* ``cuda_peer`` -- ``path="auto"``: on one node P maps D's pool and moves the request
  with one kernel launch (the transport must read ``cuda_peer``);
* ``zero_copy`` -- UCX, one put per contiguous run (``peer_copy=False``);
* ``pack`` -- UCX, packed into staging chunks, pipelined (``peer_copy=False``);
* ``contig`` -- the yardstick of the network paths: one contiguous UCX put of the same
  bytes (a one-layer ``N B C`` pool, consecutive blocks: one descriptor);
* ``nixl`` -- NIXL's UCX backend on the same request (per-block descriptors, as vLLM's
  NixlConnector prepares them), where ``nixl`` / ``nixl-cu12`` imports.

D checks every phase bitwise: it rebuilds P's pool from the same seed and compares the
received blocks with it. ``--device cpu`` runs the same code on host pools (the plumbing
check; ``cuda_peer`` then uses no mapping and is skipped).
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
PHASES = ("cuda_peer", "zero_copy", "pack", "contig", "nixl")


def make_layout(model: str, blocks: int, device: str, seed: int | None, layout: str = "per_layer"):
    """The request's pool on ``device``: random bytes from ``seed`` (zeros if None). ``layout``:
    ``per_layer``, ``cross_layer`` or ``contig`` (one layer, ``[N, B, C]``: a block's bytes in one row)."""
    import torch

    from kvxfer import KVLayout

    layers, heads, head_dim, block = MODELS[model]
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def raw(*shape):
        if seed is None:
            return torch.zeros(*shape, dtype=torch.uint8, device=device)
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)

    if layout == "per_layer":
        return KVLayout.vllm([raw(2, blocks, block, heads, head_dim * 2).view(torch.bfloat16) for _ in range(layers)])
    if layout == "cross_layer":
        return KVLayout.from_tensors(raw(blocks, layers, 2, block, heads, head_dim * 2).view(torch.bfloat16),
                                     "N L 2 B H D")
    if layout == "contig":
        width = layers * 2 * heads * head_dim  # one block's bytes of every layer, as one bf16 row per token
        return KVLayout.from_tensors([raw(blocks, block, width * 2).view(torch.bfloat16)], "N B C")
    raise ValueError(f"unknown layout {layout!r}")


def phase_layout(phase: str, layout: str) -> str:
    return "contig" if phase == "contig" else layout


def ids_for(phase: str, blocks_needed: int, pool_blocks: int, seed: int) -> list:
    """Scattered block ids (real requests); consecutive ones for the contiguous yardstick."""
    import numpy as np

    if phase == "contig":
        start = (seed * 7) % (pool_blocks - blocks_needed + 1)
        return list(range(start, start + blocks_needed))
    return np.random.default_rng(seed).choice(pool_blocks, blocks_needed, replace=False).tolist()


def agent_config(phase: str, staging_mib: int):
    from kvxfer import AgentConfig

    path = {"cuda_peer": "auto", "zero_copy": "zero_copy", "contig": "zero_copy", "pack": "pack"}[phase]
    return AgentConfig.from_env(path=path, peer_copy=phase == "cuda_peer", staging_bytes=staging_mib << 20)


def receiver(args) -> int:
    """D: per phase an agent (or a NIXL target), recvs one after another, a bitwise check."""
    import torch

    import kvxfer
    from kvxfer import Agent

    n = args.tokens // MODELS[args.model][3]
    for phase in args.phases.split(","):
        kind = phase_layout(phase, args.layout)
        dst = make_layout(args.model, args.pool_blocks, args.d_device, None, kind)
        src = make_layout(args.model, args.pool_blocks, args.d_device, args.seed, kind)  # P's bytes, to check
        src_ids, dst_ids = ids_for(phase, n, args.pool_blocks, 1), ids_for(phase, n, args.pool_blocks, 2)
        want = kvxfer.pack(src, src_ids, backend="reference")
        if phase == "nixl":
            from nixl_side import target

            path = target(dst, dst_ids, args.reps + 2, lambda info: print(json.dumps({"nixl": info}), flush=True))
        else:
            with Agent(f"d-{phase}", secret=SECRET, backend=args.backend,
                       config=agent_config(phase, args.staging_mib)) as agent:
                agent.register_kv(dst)
                print(json.dumps({"address": agent.address}), flush=True)
                for i in range(args.reps + 2):  # one at a time: a pending recv holds dst_ids (BlocksBusy)
                    h = agent.recv(f"{phase}-{i}", dst_ids, timeout=120.0)
                    h.wait(120.0)
                path, metrics = h.path, agent.metrics.to_dict()
        if dst.device.type == "cuda":
            torch.cuda.synchronize(dst.device)
        ok = torch.equal(kvxfer.pack(dst, dst_ids, backend="reference"), want)
        print(json.dumps({"phase": phase, "bitwise": ok, "path": path,
                          "metrics": metrics if phase != "nixl" else {}}), flush=True)
        del dst, src
    return 0


def timed_copies(nbytes: int, device: str, reps: int, dst_device: str | None = None) -> list:
    """Seconds of ``reps`` copies of ``nbytes`` (after two warm-ups): on ``device``, or to
    ``dst_device`` (another GPU: ``cudaMemcpyPeer``)."""
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst_device or device)
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
    from kvxfer import Agent

    phases = args.phases.split(",")
    if "nixl" in phases:
        from nixl_side import available

        if not available():
            print("nixl: not importable here, phase skipped", file=sys.stderr)
            phases.remove("nixl")
    if args.device == "cpu" and "cuda_peer" in phases:
        phases.remove("cuda_peer")  # host pools have no mapping: the phase would measure UCX again
    argv = [a for a in sys.argv[1:]]
    child = subprocess.Popen([sys.executable, __file__, *argv, "--phases", ",".join(phases), "--role", "d"],
                             stdout=subprocess.PIPE, text=True)
    n = args.tokens // MODELS[args.model][3]
    try:
        result = {"model": args.model, "tokens": args.tokens, "layout": args.layout, "device": args.device,
                  "d_device": args.d_device, "phases": []}
        nbytes = None
        for phase in phases:
            src = make_layout(args.model, args.pool_blocks, args.device, args.seed, phase_layout(phase, args.layout))
            src_ids = ids_for(phase, n, args.pool_blocks, 1)
            if nbytes is None:
                nbytes = src.wire_nbytes(n)
                result["bytes"] = nbytes
                result["copy_gbps"] = nbytes / statistics.median(timed_copies(nbytes, args.device, args.reps)) / 1e9
                if args.d_device != args.device:
                    result["peer_copy_gbps"] = nbytes / statistics.median(
                        timed_copies(nbytes, args.device, args.reps, args.d_device)) / 1e9
            assert src.wire_nbytes(n) == nbytes
            hello = read_json(child.stdout)
            times, row = [], {"phase": phase}
            if phase == "nixl":
                from nixl_side import initiator

                times = initiator(src, src_ids, hello["nixl"], args.reps + 2)
                row.update(path="nixl", transport="nixl:ucx")
            else:
                with Agent(f"p-{phase}", secret=SECRET, backend=args.backend,
                           config=agent_config(phase, args.staging_mib)) as agent:
                    agent.register_kv(src)
                    peer = agent.connect(hello["address"])
                    for i in range(args.reps + 2):
                        t0 = time.perf_counter()
                        h = agent.send(peer, f"{phase}-{i}", src_ids)
                        h.wait(120.0)
                        times.append(time.perf_counter() - t0)
                    row.update(path=h.path, transport=peer.device_transport if args.device == "cuda"
                               else peer.transport, host_lane=peer.transport, sender_metrics=agent.metrics.to_dict())
            check = read_json(child.stdout)
            median = statistics.median(times[2:])
            gbps = nbytes / median / 1e9
            yard = result.get("peer_copy_gbps", result["copy_gbps"])
            row.update(gbps=gbps, ratio_to_copy=gbps / yard, median_ms=median * 1e3,
                       samples_ms=[t * 1e3 for t in times[2:]], bitwise=check["bitwise"], recv_path=check["path"],
                       receiver_metrics=check.get("metrics"))
            result["phases"].append(row)
            del src
        child.wait(60)
        contig = next((p["gbps"] for p in result["phases"] if p["phase"] == "contig"), None)
        for row in result["phases"]:
            if contig:
                row["ratio_to_contig"] = row["gbps"] / contig
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
    ap.add_argument("--device", default="cuda", help="P's pool (cuda, cuda:0, cpu)")
    ap.add_argument("--d-device", default=None, help="D's pool (default: --device; cuda:1 on a two-GPU node)")
    ap.add_argument("--model", choices=sorted(MODELS), default="Llama-3-8B")
    ap.add_argument("--layout", choices=("per_layer", "cross_layer"), default="per_layer")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--pool-blocks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phases", default="cuda_peer,zero_copy,pack,contig,nixl")
    ap.add_argument("--backend", default="ucx")
    ap.add_argument("--staging-mib", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    args.d_device = args.d_device or args.device
    bad = [p for p in args.phases.split(",") if p not in PHASES]
    if bad:
        ap.error(f"unknown phase {bad[0]!r}; choose from {', '.join(PHASES)}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return receiver(args) if args.role == "d" else sender(args)


if __name__ == "__main__":
    sys.exit(main())
