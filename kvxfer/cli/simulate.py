"""``kvxfer simulate``: replay a trace on simulated clusters on the virtual clock, no processes.

    kvxfer simulate --trace T.jsonl --profile h100-llama2-7b-vidur --config colocated:8 \\
        --config 2P6D --config conditional:2P6D --config adaptive:2P6D --slo 2500,150 --json s.json
    kvxfer simulate --trace T.jsonl --profile a100-opt13b-distserve --config 1P1D@2,1 \\
        --no-enable-chunked-prefill --slo 200,100

Each ``--config`` (``colocated:N[@K]``, ``xPyD[@A[,B]]``, ``conditional:xPyD``,
``adaptive:xPyD``; docs/simulate.md) runs the real scheduler, block manager, router and
rebalancer decisions with the profile's modelled step and transfer times
(:mod:`kvxfer.sim.vclock`, :mod:`kvxfer.sim.replay`). Goodput and SLO attainment are
``kvxfer loadgen``'s (:mod:`kvxfer.loadgen.metrics`).
"""
from __future__ import annotations

import json

DEFAULT_TRACE = "benchmarks/traces/mooncake_conversation_1000.jsonl"  # in the repository


def add_common(p) -> None:
    """The trace, profile, engine and SLO options ``simulate`` and ``plan`` share."""
    from .serve import add_adaptive_timing

    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help=f"Mooncake jsonl trace (default {DEFAULT_TRACE}, from the repository root)")
    p.add_argument("--profile", required=True, help="cost profile: a shipped name or a JSON file")
    p.add_argument("--start", type=int, default=0, help="first trace line (0-based)")
    p.add_argument("--max-requests", type=int, default=None, help="at most this many requests")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace timestamps (0.1 = 10x rate)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply input/output lengths (as kvxfer loadgen)")
    p.add_argument("--output-scale", type=float, default=None,
                   help="multiply output lengths instead (default: --length-scale)")
    p.add_argument("--arrival-jitter-ms", type=float, default=0.0, metavar="MS",
                   help="spread each arrival within a window, as kvxfer loadgen (--seed)")
    p.add_argument("--seed", type=int, default=0, help="jitter seed, as kvxfer loadgen")
    p.add_argument("--routing", choices=("least-loaded", "kv"), default="least-loaded",
                   help="how the router picks its workers (kvxfer serve --routing)")
    p.add_argument("--routing-load-gap", type=int, default=None, metavar="N",
                   help="--routing kv: as kvxfer serve (default 4)")
    p.add_argument("--routing-overlap-weight", type=float, default=None, metavar="W",
                   help="--routing kv: as kvxfer serve (default 4)")
    p.add_argument("--store", default=None, metavar="NODESxBLOCKS",
                   help="a KV pool the prefill workers use, as kvxfer serve --store: NODES store "
                        "nodes of BLOCKS one-block slots each (e.g. 2x125000; default: none)")
    add_adaptive_timing(p)  # as kvxfer serve's
    p.add_argument("--sim-devices", type=int, default=None, metavar="K",
                   help="the workers share K devices (a step runs at min(1, K/busy workers) "
                        "speed), as kvxfer serve --sim-devices; default: a device each")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per worker (default: the profile's KV capacity at the "
                        "worker's TP degree, else 1024)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences a step (default: the profiled engine's, else 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens a step (default: the profiled engine's, with or without "
                        "chunked prefill, else 512)")
    p.add_argument("--no-enable-chunked-prefill", dest="chunked_prefill", action="store_false",
                   help="whole prompts, run before any decode (vLLM's flag; default: chunked "
                        "prefill, prompt chunks beside the decodes)")
    p.add_argument("--json", metavar="FILE", help="write {best, configs: [...]} and the records")


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="virtual-clock replay of a trace on simulated clusters",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--config", action="append", required=True, metavar="CONFIG",
                   help="colocated:N[@K], xPyD[@A[,B]], conditional:xPyD or adaptive:xPyD "
                        "(repeatable)")
    p.add_argument("--slo", default=None, metavar="TTFT_MS,TPOT_MS", help="SLO for goodput")
    p.set_defaults(func=run)


def trace_slice(args):
    """The ``--trace`` slice options as a :class:`kvxfer.sim.replay.TraceSlice`."""
    from ..sim.replay import TraceSlice

    return TraceSlice(args.trace, start=args.start, max_requests=args.max_requests,
                      time_scale=args.time_scale, length_scale=args.length_scale,
                      output_scale=args.output_scale, jitter_ms=args.arrival_jitter_ms,
                      seed=args.seed)


def run_options(args):
    """The engine, routing, store and rebalancer options as :class:`kvxfer.sim.replay.RunOptions`."""
    from ..serving.server.adaptive_policy import AdaptivePolicy
    from ..sim.replay import RunOptions
    from ..sim.store import StoreSpec

    knobs = {}
    if args.routing == "kv":
        knobs = {k: v for k, v in (("load_gap", args.routing_load_gap),
                                   ("overlap_weight", args.routing_overlap_weight)) if v is not None}
    default = AdaptivePolicy()
    policy = AdaptivePolicy(interval_s=getattr(args, "adaptive_interval", default.interval_s),
                            min_dwell_s=getattr(args, "adaptive_dwell", default.min_dwell_s))
    return RunOptions(routing=args.routing, routing_knobs=tuple(sorted(knobs.items())),
                      store=None if args.store is None else StoreSpec.parse(args.store),
                      sim_devices=args.sim_devices, num_blocks=args.num_blocks,
                      max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      chunked_prefill=args.chunked_prefill, adaptive=policy)


def print_rows(title: str, rows: list[dict], best: str) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    table = [{"config": r["name"] + (" *" if r["name"] == best else ""),
              "goodput": fmt(r["goodput_rps"], ".3f"),
              "attain": fmt(None if r["slo_attainment"] is None else 100 * r["slo_attainment"], ".1f"),
              "rps": f"{r['request_throughput']:.3f}",
              "ttft50": f"{r['ttft_p50_ms']:.0f}", "ttft99": f"{r['ttft_p99_ms']:.0f}",
              "tpot50": f"{r['tpot_p50_ms']:.1f}", "tpot99": f"{r['tpot_p99_ms']:.1f}",
              "hits": f"{100 * r['prefix_hit_ratio']:.1f}"} for r in rows]
    cols = [("config", "config"), ("goodput req/s", "goodput"), ("SLO met %", "attain"),
            ("req/s", "rps"), ("TTFT p50 ms", "ttft50"), ("TTFT p99", "ttft99"),
            ("TPOT p50 ms", "tpot50"), ("TPOT p99", "tpot99"), ("prefix hit %", "hits")]
    print_table(title, cols, table, f"best: {best}")


def print_table(title: str, cols: list[tuple[str, str]], table: list[dict], caption: str) -> None:
    """``table`` (dicts of strings) under ``cols`` ``(header, key)``: rich where installed."""
    from .. import report

    try:
        report.print_table(title, cols, table, caption=caption)
    except ImportError:  # rich is in the bench extra; the virtual clock needs none of it
        widths = [max(len(head), *(len(row[key]) for row in table)) for head, key in cols]
        print(title)
        print("  ".join(head.rjust(w) for (head, _), w in zip(cols, widths)))
        for row in table:
            print("  ".join(row[key].rjust(w) for (_, key), w in zip(cols, widths)))
        print(caption)


def write_json(path: str, best: str | None, rows: list[dict], extra: dict) -> None:
    doc = {"best": best, "configs": rows, **extra}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def load_inputs(args):
    """(profile, slo or None, the slice, run options, requests); ``SystemExit`` with a clear
    message on bad input."""
    from ..loadgen.metrics import SLO
    from ..serving.simulated.profile import ProfileError, load_profile

    try:
        slo = SLO.parse(args.slo) if args.slo else None
        options = run_options(args)  # checked before the trace is read
        profile = load_profile(args.profile)
        sliced = trace_slice(args)
        requests = sliced.arrivals()
    except (ProfileError, ValueError) as exc:
        raise SystemExit(f"kvxfer {args.command}: {exc}") from None
    return profile, slo, sliced, options, requests


def run(args) -> int:
    from ..sim.configs import ConfigError, layout_of
    from ..sim.plan import attainment
    from ..sim.replay import best_of, run_config
    from ..sim.vclock import prompt_hashes

    try:
        for name in args.config:  # every name checked before anything runs
            layout_of(name)
    except ConfigError as exc:
        raise SystemExit(f"kvxfer simulate: {exc}") from None
    profile, slo, _, options, requests = load_inputs(args)
    hashes = prompt_hashes(requests, profile.block_size)  # once for every configuration
    try:
        rows = [run_config(name, options, profile, slo, requests, hashes) for name in args.config]
    except (ValueError, RuntimeError) as exc:  # ProfileError, ConfigError among them
        raise SystemExit(f"kvxfer simulate: {exc}") from None
    if slo is not None:
        for row in rows:  # DistServe's two counts: each SLO on its own
            recs = row["records"]
            row["ttft_attainment"] = attainment(recs, type(slo)(slo.ttft_ms, float("inf")), "both")
            row["tpot_attainment"] = attainment(recs, type(slo)(float("inf"), slo.tpot_ms), "both")
    best = best_of(rows)
    print_rows(f"virtual clock: {len(requests)} requests, profile {profile.name}", rows, best)
    if args.json:
        write_json(args.json, best, rows, {"profile": profile.name, "routing": args.routing,
                                           "store": args.store, "slo": args.slo,
                                           "sim_devices": args.sim_devices,
                                           "chunked_prefill": args.chunked_prefill,
                                           "num_requests": len(requests)})
    return 0
