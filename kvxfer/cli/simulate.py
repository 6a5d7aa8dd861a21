"""``kvxfer simulate``: replay a trace on simulated clusters on the virtual clock, no processes.

    kvxfer simulate --trace T.jsonl --profile h100-llama2-7b-vidur --config colocated:8 \\
        --config 2P6D --config conditional:2P6D --config adaptive:2P6D --slo 2500,150 --json s.json

Each ``--config`` (``colocated:N``, ``xPyD``, ``conditional:xPyD``, ``adaptive:xPyD``;
docs/simulate.md) runs the real scheduler, block manager, router and rebalancer
decisions with the profile's modelled step and transfer times (:mod:`kvxfer.sim.vclock`).
Goodput and SLO attainment are ``kvxfer loadgen``'s (:mod:`kvxfer.loadgen.metrics`).
"""
from __future__ import annotations

import json

DEFAULT_TRACE = "../shared/traces/mooncake_conversation_trace.jsonl"


def add_common(p) -> None:
    """The trace, profile, engine and SLO options ``simulate`` and ``plan`` share."""
    from ..serving.engine.config import EngineConfig
    from .serve import add_adaptive_timing

    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake jsonl trace")
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
    p.add_argument("--num-blocks", type=int, default=EngineConfig.num_blocks,
                   help="KV blocks per worker")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--json", metavar="FILE", help="write {best, configs: [...]} and the records")


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="virtual-clock replay of a trace on simulated clusters",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--config", action="append", required=True, metavar="CONFIG",
                   help="colocated:N, xPyD, conditional:xPyD or adaptive:xPyD (repeatable)")
    p.add_argument("--slo", default=None, metavar="TTFT_MS,TPOT_MS", help="SLO for goodput")
    p.set_defaults(func=run)


def arrivals(args, time_scale: float | None = None) -> list[tuple[float, list[int], int]]:
    """The trace slice as ``(arrival_s, prompt_ids, max_tokens)``, prompts built as
    ``kvxfer loadgen`` builds them (:class:`kvxfer.loadgen.prompts.PromptBuilder`)."""
    from ..loadgen.prompts import PromptBuilder
    from ..loadgen.trace import jitter, read_trace

    scale = args.time_scale if time_scale is None else time_scale
    if not scale > 0:
        raise ValueError(f"--time-scale must be > 0, got {scale}")
    try:
        reqs = read_trace(args.trace, start=args.start, max_requests=args.max_requests)
    except OSError as exc:
        raise ValueError(f"cannot read trace {args.trace}: {exc.strerror}") from None
    if args.arrival_jitter_ms:  # as kvxfer loadgen spreads them (sorted by the new time)
        reqs = jitter(reqs, args.arrival_jitter_ms, seed=args.seed)
    prompts = PromptBuilder(length_scale=args.length_scale, output_scale=args.output_scale)
    return [(r.timestamp_ms * scale / 1e3, prompts.prompt_ids(r), prompts.max_tokens(r))
            for r in reqs]


def routing_knobs(args) -> dict:
    """The kv policy's knobs given on the command line (none for least-loaded)."""
    if args.routing != "kv":
        return {}
    knobs = {"load_gap": getattr(args, "routing_load_gap", None),
             "overlap_weight": getattr(args, "routing_overlap_weight", None)}
    return {k: v for k, v in knobs.items() if v is not None}


def adaptive_policy(args):
    """The rebalancer's policy of adaptive configurations: default thresholds, with
    ``--adaptive-interval`` and ``--adaptive-dwell`` where ``args`` has them."""
    from ..serving.server.adaptive_policy import AdaptivePolicy

    default = AdaptivePolicy()
    return AdaptivePolicy(interval_s=getattr(args, "adaptive_interval", default.interval_s),
                          min_dwell_s=getattr(args, "adaptive_dwell", default.min_dwell_s))


def store_spec(args):
    """The ``--store`` pool (:class:`kvxfer.sim.store.StoreSpec`), or None."""
    from ..sim.store import StoreSpec

    text = getattr(args, "store", None)
    return None if text is None else StoreSpec.parse(text)


def run_config(name: str, args, profile, slo, requests, hashes=None, *, twin: bool = False,
               routed_hits: bool = True) -> dict:
    """One configuration on the virtual clock: ``{"name", "goodput_rps", "slo_attainment",
    "summary", ...}``; ``goodput_rps`` and attainment are None without an SLO. ``hashes``:
    :func:`kvxfer.sim.vclock.prompt_hashes` of ``requests`` (computed once for many runs).
    ``twin`` (a static ``xPyD`` of >= 3 workers): the run also watches ``adaptive:xPyD``'s
    rebalancer (:func:`kvxfer.sim.vclock.simulate`); ``row["twin"]`` is that configuration's
    row where its rebalancer never moved a worker (the same run), else None.
    ``routed_hits=False``: ``routed_hit_ratio`` is None where the policy does not pick by
    prefix (:func:`kvxfer.sim.vclock.simulate`; a cheaper run)."""
    from ..loadgen.metrics import summarize_run
    from ..sim.configs import parse_config
    from ..sim.vclock import simulate

    engine = dict(num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    if getattr(args, "sim_devices", None) is not None:
        engine.update(engine="sim", profile=profile.name, sim_devices=args.sim_devices)
    slo_ms = (slo.ttft_ms, slo.tpot_ms) if slo else None
    policy = adaptive_policy(args)
    config = parse_config(name, slo_ms=slo_ms, adaptive=policy, **engine)
    twin_config = (parse_config(f"adaptive:{name}", slo_ms=slo_ms, adaptive=policy, **engine)
                   if twin else None)
    result = simulate(config, profile, requests, routing=args.routing, prompt_hashes=hashes,
                      twin=twin_config, routed_hits=routed_hits, store=store_spec(args),
                      **routing_knobs(args))
    summary = summarize_run(result.records, slo)
    row = _row(name, summary, result, result.end_s)
    if twin:
        row["twin"] = (None if result.twin_end_s is None
                       else _row(f"adaptive:{name}", summary, result, result.twin_end_s,
                                 dict(result.counters)))
    return row


def _row(name: str, summary: dict, result, end_s: float, counters: dict | None = None) -> dict:
    counts = result.counters if counters is None else counters
    return {"name": name, "goodput_rps": summary.get("goodput"),
            "slo_attainment": summary.get("slo_attainment"),
            "request_throughput": summary["request_throughput"],
            "ttft_p50_ms": summary["ttft_ms"]["median"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["median"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "prefix_hit_ratio": (counts["hit_tokens"] / counts["query_tokens"]
                                 if counts.get("query_tokens") else 0.0),
            "routed_hit_ratio": (None if "routed_prompt_blocks" not in counts
                                 else counts["routed_hit_blocks"] / counts["routed_prompt_blocks"]
                                 if counts["routed_prompt_blocks"] else 0.0),
            # prompt tokens prefill workers loaded from the KV pool (--store), else None
            "store_hit_tokens": counts.get("store_hit_tokens"),
            "virtual_s": end_s, "counters": counts, "records": result.records}


def best_of(rows: list[dict]) -> str:
    """The name of the row with the highest goodput (request throughput without an SLO)."""
    key = "goodput_rps" if rows[0]["goodput_rps"] is not None else "request_throughput"
    return max(rows, key=lambda r: r[key])["name"]


def print_rows(title: str, rows: list[dict], best: str) -> None:
    from .. import report

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
    try:
        report.print_table(title, cols, table, caption=f"best: {best}")
    except ImportError:  # rich is in the bench extra; the virtual clock needs none of it
        widths = [max(len(head), *(len(row[key]) for row in table)) for head, key in cols]
        print(title)
        print("  ".join(head.rjust(w) for (head, _), w in zip(cols, widths)))
        for row in table:
            print("  ".join(row[key].rjust(w) for (_, key), w in zip(cols, widths)))
        print(f"best: {best}")


def write_json(path: str, best: str, rows: list[dict], extra: dict) -> None:
    doc = {"best": best, "configs": rows, **extra}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def load_inputs(args):
    """(profile, slo or None, requests); ``SystemExit`` with a clear message on bad input."""
    from ..loadgen.metrics import SLO
    from ..sim.profile import ProfileError, load_profile

    try:
        slo = SLO.parse(args.slo) if args.slo else None
        store_spec(args)  # checked before the trace is read
        adaptive_policy(args)
        profile = load_profile(args.profile)
        requests = arrivals(args)
    except (ProfileError, ValueError) as exc:
        raise SystemExit(f"kvxfer {args.command}: {exc}") from None
    return profile, slo, requests


def run(args) -> int:
    from ..sim.configs import ConfigError, parse_config
    from ..sim.vclock import prompt_hashes

    try:
        for name in args.config:  # every name checked before anything runs
            parse_config(name)
    except ConfigError as exc:
        raise SystemExit(f"kvxfer simulate: {exc}") from None
    profile, slo, requests = load_inputs(args)
    hashes = prompt_hashes(requests, profile.block_size)  # once for every configuration
    try:
        rows = [run_config(name, args, profile, slo, requests, hashes) for name in args.config]
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvxfer simulate: {exc}") from None
    best = best_of(rows)
    print_rows(f"virtual clock: {len(requests)} requests, profile {profile.name}", rows, best)
    if args.json:
        write_json(args.json, best, rows, {"profile": profile.name, "routing": args.routing,
                                           "store": args.store, "slo": args.slo,
                                           "sim_devices": args.sim_devices,
                                           "num_requests": len(requests)})
    return 0
