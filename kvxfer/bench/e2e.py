"""``kvxfer bench e2e``: one request's KV moved pool -> pool between two processes.

D (this process) owns the decode pool(s); P (spawned, one per prefill TP rank)
owns a prefill pool of seeded random bytes. P posts every send up front; D times
each request from ``recv`` posted to every byte visible in its blocks (RECV_POST,
path choice, zero-copy or pack, DATA_DONE). Block ids are a random sample of the pool in
random order on both sides. Every timed request is verified: D's pools are zeroed
before it and every destination byte is compared with P's after it
(:mod:`.e2e_run`). The yardstick is a native copy of the same bytes on as many
threads as the path copies with, sampled after each request. A second phase
times 1-block requests (recv posted -> both handles done): p50 and p99.
``--compare nixl`` also times NIXL writing the same bytes as per-block
descriptors, in the same run, with the same copy threads and no spinning
progress thread (:mod:`.nixl`).
"""
from __future__ import annotations

import json

from .e2e_pools import LAYOUTS, MODELS
from .e2e_run import TIMEOUT_S, measure


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
    parser.add_argument("--memory", choices=["shared", "torch"], default="shared",
                        help="pool memory: kvxfer.shared_empty (same-host peers copy with memcpy) or torch.empty")
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
                backend=args.backend, memory=args.memory)
    for key in ("p_layout", "d_layout"):
        if spec[key] not in LAYOUTS:
            raise SystemExit(f"--layout: unknown layout {spec[key]!r}")
    if spec["heads"] % spec["p_tp"] or spec["heads"] % spec["d_tp"]:
        raise SystemExit("--tp must divide the kv heads")
    if args.iters < 1 or args.warmup < 0 or args.rtt_iters < 0:
        raise SystemExit("--iters must be >= 1, --warmup and --rtt-iters >= 0")
    spec["pool_blocks"] = spec["blocks"] + spec["blocks"] // 4 + 8
    return spec


def _median(xs) -> float:
    from ..report.stats import percentile

    return percentile(xs, 50)


def nixl_seconds(spec: dict, iters: int, warmup: int, threads: int) -> list:
    """NIXL writing the request's bytes as one descriptor per (layer, K/V, block), the way
    vLLM's NixlConnector describes a paged pool; data path only (no request matching)."""
    import torch

    from .nixl import NixlSession

    itemsize = torch.empty(0, dtype=getattr(torch, spec["dtype"])).element_size()
    run_bytes = spec["block_size"] * spec["heads"] * spec["head_dim"] * itemsize
    batch = spec["layers"] * 2 * spec["blocks"]
    with NixlSession(2 * batch * run_bytes + (1 << 20), timeout=TIMEOUT_S, threads=threads) as session:
        return session.measure(run_bytes, batch, "write", iters, warmup)["latency_s"]


def _summarize(res: dict) -> None:
    from ..report.stats import percentile

    t_med, m_med = _median(res["seconds"]), _median(res["memcpy_seconds"])
    res["gbps"], res["memcpy_gbps"] = res["bytes"] / t_med / 1e9, res["bytes"] / m_med / 1e9
    res["ratio_to_memcpy"] = m_med / t_med
    rtts = res["rtt_seconds"]
    res["rtt_p50_us"] = percentile(rtts, 50) * 1e6 if rtts else None
    res["rtt_p99_us"] = percentile(rtts, 99) * 1e6 if rtts else None
    if "nixl_seconds" in res:
        res["nixl_gbps"] = res["bytes"] / _median(res["nixl_seconds"]) / 1e9
        res["ratio_to_nixl"] = _median(res["nixl_seconds"]) / t_med


def run(args) -> int:
    from .. import report
    from ..errors import KVXferError
    from ..report import envinfo

    spec = _spec(args)
    if args.compare and (spec["p_tp"], spec["d_tp"]) != (1, 1):
        raise SystemExit("--compare nixl needs --tp 1:1")
    if args.compare:
        from .nixl import available

        if available() is None:
            report.warn("--compare nixl: NIXL is not importable here (pip install --no-deps nixl-cu12); "
                        "nothing was measured")
            return 2
    warning = envinfo.busy_warning()
    if warning:
        report.warn(warning)
    load = envinfo.load_average()
    try:
        res = measure(spec, args.iters, args.warmup, args.rtt_iters)
        if args.compare:
            res["nixl_threads"] = res["memcpy_resources"]["threads"]
            res["nixl_seconds"] = nixl_seconds(spec, args.iters, args.warmup, res["nixl_threads"])
    except KVXferError as exc:
        report.warn(str(exc))
        return 1
    _summarize(res)
    res["bitwise_ok"] = True  # measure() raised on any wrong byte
    res["environment"] = envinfo.collect(transport=res["transport"], backend=spec["backend"])
    res["environment"]["load_average_at_start"] = list(load)
    lim = res["memcpy_resources"]
    print(f"model={args.model} tokens={args.tokens} block={spec['block_size']} layout={args.layout} "
          f"tp={args.tp} dtype={spec['dtype']} memory={spec['memory']} path={res['path']} "
          f"transport={res['transport']}")
    print(f"  {res['bytes'] / 1e6:.1f} MB  median {_median(res['seconds']) * 1e3:.2f} ms  "
          f"{res['gbps']:.2f} GB/s  memcpy ({lim['threads']} thr{', NT' if lim['streaming'] else ''}) "
          f"{res['memcpy_gbps']:.2f} GB/s  ratio {res['ratio_to_memcpy']:.2f}  "
          f"verified {res['verified_requests']}/{res['verified_requests']} requests bitwise")
    if "nixl_gbps" in res:
        print(f"  NIXL (per-block descriptors, same run, {res['nixl_threads']} thr, no progress thread) "
              f"{res['nixl_gbps']:.2f} GB/s  kvxfer/NIXL {res['ratio_to_nixl']:.2f}")
    if res["rtt_p50_us"] is not None:
        print(f"  1-block round trip: p50 {res['rtt_p50_us']:.0f} us  p99 {res['rtt_p99_us']:.0f} us")
    thp = res["environment"]["transparent_huge_pages"]
    print(f"  load average at start {load[0]:.2f} (1 min) on {envinfo.num_cores()} cores; "
          f"transparent huge pages: anon {thp['anon']}, shmem {thp['shmem']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
