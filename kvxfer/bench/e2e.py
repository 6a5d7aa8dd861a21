"""``kvxfer bench e2e``: one request's KV moved pool -> pool between two processes.

D (this process) owns the decode pool(s); P (spawned, one per prefill TP rank)
owns a prefill pool filled with a deterministic pattern. P posts every send up
front; D times each request from ``recv`` posted to every byte visible in its
blocks (RECV_POST, plan, zero-copy or pack, DATA_DONE). Block ids are a random
sample of the pool in random order on both sides. The yardstick is a
single-thread memcpy of the same number of bytes, sampled after each timed request. A second phase
times 1-block requests (recv posted -> both handles done): p50 and p99.
``--compare nixl`` also times NIXL writing the same bytes as per-block
descriptors, in the same run.
After the run, D checks the last request's bytes against P's CRC of its blocks.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import time
import zlib

MODELS = {  # layers, kv heads (whole model), head dim
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (80, 8, 128),
    "smollm2-135m": (30, 3, 64),
}
LAYOUTS = {"nhd": "2 N B H D", "hnd": "N 2 H B D", "blocks-first": "N 2 B H D", "cross": "N L 2 B H D"}
SECRET = b"kvxfer-bench-e2e"
TIMEOUT_S = 120.0


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=[*MODELS, "custom"], default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4, help="custom model: layers")
    parser.add_argument("--heads", type=int, default=8, help="custom model: kv heads")
    parser.add_argument("--head-dim", type=int, default=128, help="custom model: head dim")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layout", default="nhd:nhd", help=f"P:D pool layouts, each one of {', '.join(LAYOUTS)}")
    parser.add_argument("--tp", default="1:1", help="P:D tensor parallel sizes (1:1, 2:1, 1:2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--path", choices=["auto", "zero_copy", "pack"], default="auto")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rtt-iters", type=int, default=200, help="1-block round trips (0: skip)")
    parser.add_argument("--compare", choices=["nixl"], help="also time NIXL moving the same bytes as "
                        "per-block descriptors (vLLM NixlConnector style), same run; needs tp 1:1")
    parser.add_argument("--json", metavar="FILE")


def _spec(args) -> dict:
    layers, heads, head_dim = MODELS.get(args.model, (args.layers, args.heads, args.head_dim))
    p_lay, _, d_lay = args.layout.partition(":")
    p_tp, _, d_tp = args.tp.partition(":")
    spec = dict(layers=layers, heads=heads, head_dim=head_dim, block_size=args.block_size,
                blocks=-(-args.tokens // args.block_size), dtype=args.dtype, p_layout=p_lay,
                d_layout=d_lay or p_lay, p_tp=int(p_tp), d_tp=int(d_tp or 1), path=args.path,
                backend=args.backend)
    for key in ("p_layout", "d_layout"):
        if spec[key] not in LAYOUTS:
            raise SystemExit(f"--layout: unknown layout {spec[key]!r}")
    if spec["heads"] % spec["p_tp"] or spec["heads"] % spec["d_tp"]:
        raise SystemExit("--tp must divide the kv heads")
    spec["pool_blocks"] = spec["blocks"] + spec["blocks"] // 4 + 8
    return spec


def make_layout(spec: dict, which: str, rank: int, fill: bool):
    """A pool of ``pool_blocks`` blocks in the chosen layout; ``fill``: a deterministic pattern."""
    import torch

    from ..layout import KVLayout

    dims = LAYOUTS[spec[f"{which}_layout"]]
    tp = spec[f"{which}_tp"]
    sizes = {"L": spec["layers"], "N": spec["pool_blocks"], "2": 2, "B": spec["block_size"],
             "H": spec["heads"] // tp, "D": spec["head_dim"]}
    shape = [sizes[c] for c in dims.split()]
    dtype = getattr(torch, spec["dtype"])
    count = 1 if "L" in dims else spec["layers"]
    tensors = []
    for layer in range(count):
        t = torch.empty(shape, dtype=dtype)
        raw = t.view(torch.uint8).view(-1)
        if fill:  # cheap, position-dependent bytes; distinct per layer and rank
            torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1000 * rank + layer), out=raw)
        else:
            raw.zero_()
        tensors.append(t)
    return KVLayout.from_tensors(tensors if count > 1 else tensors[0], dims, tp_rank=rank, tp_size=tp)


def _ids(spec: dict, seed: int) -> list:
    import random

    return random.Random(seed).sample(range(spec["pool_blocks"]), spec["blocks"])


def _prefill(spec: dict, rank: int, d_addresses: list, requests: list, rtt: int, q) -> None:
    from ..agent import Agent
    from ..kernels import pack

    try:
        layout = make_layout(spec, "p", rank, fill=True)
        with Agent(f"prefill-{rank}", secret=SECRET, backend=spec["backend"], path=spec["path"]) as agent:
            agent.register_kv(layout)
            peers = [agent.connect(a, timeout=TIMEOUT_S) for a in d_addresses]
            src = _ids(spec, 1)
            q.put(("ready", rank))
            handles = [agent.send(p, r, src) for r in requests for p in peers]
            handles += [agent.send(p, f"rtt-{i}", [src[0]]) for i in range(rtt) for p in peers]
            for h in handles:
                h.wait(TIMEOUT_S)
            crcs = {}
            for p in peers:
                heads = (max(layout.head_range[0], p.geometry.head_range[0]),
                         min(layout.head_range[1], p.geometry.head_range[1]))
                crcs[p.geometry.head_lo] = zlib.crc32(pack(layout, src, heads=heads).numpy().tobytes())
            q.put(("done", {"rank": rank, "transport": peers[0].transport, "crcs": crcs,
                            "paths": sorted({h.path for h in handles}),
                            "metrics": agent.metrics.to_dict()["histograms"]}))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        q.put(("error", f"{type(exc).__name__}: {exc}"))


def _median(xs):
    from .stats import percentile

    return percentile(xs, 50)


def measure(spec: dict, iters: int, warmup: int, rtt_iters: int) -> dict:
    from ..agent import Agent
    from ..kernels import pack
    from .limits import MemcpyLimit
    from .stats import percentile

    ctx = mp.get_context("spawn")
    d_agents = []
    procs = []
    q = ctx.Queue()
    try:
        for rank in range(spec["d_tp"]):
            a = Agent(f"decode-{rank}", secret=SECRET, backend=spec["backend"], path=spec["path"])
            a.register_kv(make_layout(spec, "d", rank, fill=False))
            d_agents.append(a)
        requests = [f"req-{i}" for i in range(warmup + iters)]
        for rank in range(spec["p_tp"]):
            proc = ctx.Process(target=_prefill, daemon=True,
                               args=(spec, rank, [a.address for a in d_agents], requests, rtt_iters, q))
            proc.start()
            procs.append(proc)
        for _ in procs:
            msg = q.get(timeout=TIMEOUT_S)
            if msg[0] != "ready":
                raise RuntimeError(f"prefill process failed: {msg[1]}")
        dst = _ids(spec, 2)
        nbytes = sum(a._layout.wire_nbytes(len(dst)) for a in d_agents)
        # The memcpy limit is sampled between requests (same bytes count, same run, same
        # moment), so drift in the host's memory bandwidth hits both alike.
        limit = MemcpyLimit(nbytes)
        limit.seconds(1, warmup=1)
        times, memcpy = [], []
        for i, req in enumerate(requests):
            t0 = time.perf_counter()
            hs = [a.recv(req, dst, timeout=TIMEOUT_S) for a in d_agents]
            for h in hs:
                h.wait(TIMEOUT_S)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                memcpy.append(limit.sample())
        del limit
        path = hs[0].path
        rtts = []
        for i in range(rtt_iters):
            t0 = time.perf_counter()
            hs = [a.recv(f"rtt-{i}", [dst[0]], timeout=TIMEOUT_S) for a in d_agents]
            for h in hs:
                h.wait(TIMEOUT_S)
            rtts.append(time.perf_counter() - t0)
        results = [q.get(timeout=TIMEOUT_S) for _ in procs]
        for status, info in results:
            if status != "done":
                raise RuntimeError(f"prefill process failed: {info}")
        compared, ok = 0, True
        for _, info in results:  # each P rank's CRC of the heads it sent to each D rank
            p_lo = info["rank"] * spec["heads"] // spec["p_tp"]
            p_hi = (info["rank"] + 1) * spec["heads"] // spec["p_tp"]
            for head_lo, crc in info["crcs"].items():
                a = next(a for a in d_agents if a._geometry.head_lo == int(head_lo))
                lo, hi = max(a._layout.head_range[0], p_lo), min(a._layout.head_range[1], p_hi)
                got = zlib.crc32(pack(a._layout, dst, heads=(lo, hi)).numpy().tobytes())
                ok &= got == crc
                compared += 1
        ok &= compared >= max(spec["p_tp"], spec["d_tp"])
        t_med, m_med = _median(times), _median(memcpy)
        return {"spec": spec, "bytes": nbytes, "seconds": times, "memcpy_seconds": memcpy,
                "gbps": nbytes / t_med / 1e9, "memcpy_gbps": nbytes / m_med / 1e9,
                "ratio_to_memcpy": m_med / t_med, "path": path, "transport": results[0][1]["transport"],
                "rtt_p50_us": percentile(rtts, 50) * 1e6 if rtts else None,
                "rtt_p99_us": percentile(rtts, 99) * 1e6 if rtts else None,
                "bitwise_ok": bool(ok), "sender_histograms": results[0][1]["metrics"]}
    finally:
        for a in d_agents:
            a.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


def nixl_seconds(spec: dict, iters: int, warmup: int) -> list:
    """NIXL writing the request's bytes as one descriptor per (layer, K/V, block), the way
    vLLM's NixlConnector describes a paged pool; data path only (no request matching)."""
    import torch

    from .nixl import NixlSession

    itemsize = torch.empty(0, dtype=getattr(torch, spec["dtype"])).element_size()
    run_bytes = spec["block_size"] * spec["heads"] * spec["head_dim"] * itemsize
    batch = spec["layers"] * 2 * spec["blocks"]
    with NixlSession(2 * batch * run_bytes + (1 << 20), timeout=TIMEOUT_S) as session:
        return session.measure(run_bytes, batch, "write", iters, warmup)["latency_s"]


def run(args) -> int:
    spec = _spec(args)
    if args.compare and (spec["p_tp"], spec["d_tp"]) != (1, 1):
        raise SystemExit("--compare nixl needs --tp 1:1")
    res = measure(spec, args.iters, args.warmup, args.rtt_iters)
    if args.compare:
        res["nixl_seconds"] = nixl_seconds(spec, args.iters, args.warmup)
        res["nixl_gbps"] = res["bytes"] / _median(res["nixl_seconds"]) / 1e9
        res["ratio_to_nixl"] = _median(res["nixl_seconds"]) / _median(res["seconds"])
    print(f"model={args.model} tokens={args.tokens} block={spec['block_size']} layout={args.layout} "
          f"tp={args.tp} dtype={spec['dtype']} path={res['path']} transport={res['transport']}")
    print(f"  {res['bytes'] / 1e6:.1f} MB  median {_median(res['seconds']) * 1e3:.2f} ms  "
          f"{res['gbps']:.2f} GB/s  memcpy {res['memcpy_gbps']:.2f} GB/s  "
          f"ratio {res['ratio_to_memcpy']:.2f}  bitwise {'ok' if res['bitwise_ok'] else 'MISMATCH'}")
    if "nixl_gbps" in res:
        print(f"  NIXL (per-block descriptors, same run) {res['nixl_gbps']:.2f} GB/s  "
              f"kvxfer/NIXL {res['ratio_to_nixl']:.2f}")
    if res["rtt_p50_us"] is not None:
        print(f"  1-block round trip: p50 {res['rtt_p50_us']:.0f} us  p99 {res['rtt_p99_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["bitwise_ok"] else 1
