"""``kvxfer loadgen``: replay a Mooncake trace (or Poisson arrivals) against a server.

    kvxfer loadgen --url http://127.0.0.1:8000 --trace T.jsonl --max-requests 50 \\
        --length-scale 0.02 --time-scale 0.1 --slo 2000,150 --label disagg --json d.json
    kvxfer loadgen --results d.json c.json --slo 2000,150 --plot cdf.png   # compare runs
    kvxfer loadgen --trace T.jsonl ... --slo auto --calibrate-only   # single-request SLO
    kvxfer loadgen --poisson 0.5 --phases 16:400:4,16:32:48 --slo 3000,300   # shifting mix

``--slo auto`` measures single-request TTFT/TPOT on the server first (the
median-length request of the run, one at a time) and sets the SLO to
``--slo-factors`` times them; the chosen SLO and the measurement go into the
JSON. To compare modes, calibrate once and pass the same ``--slo`` to every run.
"""
from __future__ import annotations

import json

DEFAULT_TRACE = "benchmarks/traces/mooncake_conversation_trace.jsonl"  # in a clone of the repository, from its root


def add_parser(sub) -> None:
    p = sub.add_parser("loadgen", help="replay a trace against a server; TTFT/TPOT/ITL/goodput",
                       description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help=f"Mooncake jsonl trace (e.g. {DEFAULT_TRACE})")
    src.add_argument("--poisson", type=float, metavar="RATE", help="synthetic Poisson arrivals, requests/s")
    src.add_argument("--results", nargs="+", metavar="JSON", help="no run: summarize/plot saved runs")
    p.add_argument("--start", type=int, default=0, help="first trace line to replay (0-based)")
    p.add_argument("--max-requests", type=int, default=None, help="replay at most this many requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace timestamps (0.1 = 10x rate)")
    p.add_argument("--arrival-jitter-ms", type=float, default=0.0, metavar="MS",
                   help="trace mode: spread each arrival uniformly over [t, t+MS) before --time-scale "
                        "(Mooncake's timestamps are 3000 ms buckets; 0 = send each bucket at once)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply input/output token lengths")
    p.add_argument("--output-scale", type=float, default=None,
                   help="multiply output lengths by this instead of --length-scale")
    p.add_argument("--num-requests", type=int, default=100, help="Poisson mode: number of requests")
    p.add_argument("--input-len", type=int, default=256, help="Poisson mode: mean input tokens")
    p.add_argument("--output-len", type=int, default=64, help="Poisson mode: mean output tokens")
    p.add_argument("--spread", type=float, default=0.0, help="Poisson mode: lengths uniform within ±spread")
    p.add_argument("--shared-blocks", type=int, default=0, help="Poisson mode: shared-prefix 512-token blocks")
    p.add_argument("--phases", default=None, metavar="N:IN:OUT[:RATE],...",
                   help="Poisson mode: a mix that shifts mid-run, phase after phase (N requests of "
                        "IN input and OUT output tokens each, at --poisson RATE unless given); "
                        "replaces --num-requests/--input-len/--output-len")
    p.add_argument("--model", default=None, help="model name sent in requests")
    p.add_argument("--slo", default=None, metavar="TTFT_MS,TPOT_MS",
                   help="SLO for goodput, or 'auto': from single-request latencies measured first")
    p.add_argument("--slo-factors", default="3,2", metavar="TTFT_X,TPOT_X",
                   help="with --slo auto: SLO = these times the single-request TTFT, TPOT")
    p.add_argument("--calibrate-repeats", type=int, default=3, help="single requests for --slo auto")
    p.add_argument("--calibrate-only", action="store_true",
                   help="with --slo auto: print the chosen SLO and stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request, total")
    p.add_argument("--max-concurrency", type=int, default=256, help="HTTP connections")
    p.add_argument("--label", default=None, help="name of this run in tables and plots")
    p.add_argument("--json", metavar="FILE", help="write every request's record + summary")
    p.add_argument("--plot", metavar="FILE.png", help="latency CDFs (of this run or of --results)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _requests(args):
    if args.phases is not None and args.poisson is None:
        raise SystemExit("kvxfer loadgen: --phases needs --poisson RATE")
    if args.phases is not None:
        from ..loadgen.poisson import parse_phases, phased_requests

        try:
            reqs = phased_requests(parse_phases(args.phases, args.poisson), spread=args.spread,
                                   shared_blocks=args.shared_blocks, seed=args.seed)
        except ValueError as exc:
            raise SystemExit(f"kvxfer loadgen: {exc}") from None
        return reqs[: args.max_requests] if args.max_requests else reqs
    if args.poisson is not None:
        from ..loadgen.poisson import poisson_requests

        reqs = poisson_requests(rate=args.poisson, num_requests=args.num_requests,
                                input_length=args.input_len, output_length=args.output_len,
                                spread=args.spread, shared_blocks=args.shared_blocks, seed=args.seed)
        return reqs[: args.max_requests] if args.max_requests else reqs
    from ..loadgen.trace import jitter, read_trace

    reqs = read_trace(args.trace or DEFAULT_TRACE, start=args.start, max_requests=args.max_requests)
    try:
        return jitter(reqs, args.arrival_jitter_ms, seed=args.seed) if args.arrival_jitter_ms else reqs
    except ValueError as exc:
        raise SystemExit(f"kvxfer loadgen: {exc}") from None


_TABLE = (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms"), ("ITL ms", "itl_ms"), ("e2e ms", "e2e_ms"),
          ("KV % of TTFT", "kv_share_of_ttft_pct"))


def _print_summary(label: str, s: dict) -> None:
    from .. import report

    rows = [{"metric": name, **{k: s[key][k] for k in ("mean", "median", "p90", "p99")}}
            for name, key in _TABLE]
    extra = (f"requests {s['num_ok']}/{s['num_requests']} ok, {s['duration_s']:.1f} s, "
             f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} tok/s")
    if "goodput" in s:
        extra += (f"; goodput {s['goodput']:.2f} req/s at TTFT<={s['slo']['ttft_ms']:g} ms, "
                  f"TPOT<={s['slo']['tpot_ms']:g} ms ({100 * s['slo_attainment']:.0f}% met)")
    report.print_table(f"loadgen: {label}", [("metric", "metric"), ("mean", "mean"), ("p50", "median"),
                                              ("p90", "p90"), ("p99", "p99")], rows, caption=extra)


def _print_ratios(summaries: dict[str, dict]) -> None:
    """Each run against the first one: goodput, TPOT p99, TTFT p99 ratios, SLO attainment."""
    base_label, base = next(iter(summaries.items()))

    def ratio(a, b):
        return f"{a / b:.2f}x" if b and a == a and b == b else "-"

    for label, s in list(summaries.items())[1:]:
        parts = [f"TPOT p99 {ratio(s['tpot_ms']['p99'], base['tpot_ms']['p99'])}",
                 f"TTFT p99 {ratio(s['ttft_ms']['p99'], base['ttft_ms']['p99'])}"]
        if "goodput" in s:
            parts.insert(0, f"goodput {ratio(s['goodput'], base['goodput'])}")
            parts.append(f"SLO met {100 * s['slo_attainment']:.0f}% vs {100 * base['slo_attainment']:.0f}%")
        print(f"{label} vs {base_label}: " + ", ".join(parts))


def _plot(path: str, runs: dict[str, list[dict]]) -> None:
    from .. import report
    from ..loadgen.metrics import itl_values

    def ms(values):
        return [v * 1e3 for v in values if v is not None]

    ok = {label: [r for r in recs if r.get("ok")] for label, recs in runs.items()}
    panels = {
        "TTFT (ms)": {k: ms(r["ttft_s"] for r in v) for k, v in ok.items()},
        "TPOT (ms)": {k: ms(r.get("tpot_s") for r in v) for k, v in ok.items()},
        "ITL (ms)": {k: ms(itl_values(v)) for k, v in ok.items()},
        "e2e latency (ms)": {k: ms(r["e2e_s"] for r in v) for k, v in ok.items()},
    }
    report.plot_cdfs(path, panels, title="latency CDFs: " + " vs ".join(runs))


def run(args) -> int:
    from ..loadgen.metrics import SLO, summarize_run

    auto = args.slo == "auto"
    slo = SLO.parse(args.slo) if args.slo and not auto else None
    if args.results:
        if auto:
            raise SystemExit("kvxfer loadgen: --slo auto needs a server; give TTFT_MS,TPOT_MS with --results")
        runs, summaries = {}, {}
        for path in args.results:
            doc = json.loads(open(path).read())
            label = doc.get("label") or path
            if label in runs:
                label = f"{label} ({path})"
            runs[label] = doc["requests"]
            summaries[label] = summarize_run(doc["requests"], slo)
            _print_summary(label, summaries[label])
        if len(summaries) > 1:
            _print_ratios(summaries)
        if args.plot:
            _plot(args.plot, runs)
        return 0

    from .. import report
    from ..report import envinfo
    from ..loadgen.prompts import PromptBuilder
    from ..loadgen.runner import RunConfig, run as replay

    reqs = _requests(args)
    try:
        prompts = PromptBuilder(length_scale=args.length_scale, seed=args.seed, output_scale=args.output_scale)
    except ValueError as exc:
        raise SystemExit(f"kvxfer loadgen: {exc}") from None
    cfg = RunConfig(url=args.url, model=args.model, time_scale=args.time_scale,
                    request_timeout=args.request_timeout, max_concurrency=args.max_concurrency,
                    seed=args.seed)
    warning = envinfo.busy_warning()
    if warning:
        report.warn(warning)
    calibration = None
    if auto:
        from ..loadgen.calibrate import measure_single, parse_factors, representative

        try:
            calibration = measure_single(args.url, representative(reqs), prompts,
                                         repeats=args.calibrate_repeats, model=args.model,
                                         timeout=args.request_timeout,
                                         factors=parse_factors(args.slo_factors))
        except (RuntimeError, ValueError) as exc:
            raise SystemExit(f"kvxfer loadgen: calibration failed: {exc}") from None
        slo = calibration.slo
        print(f"single request ({calibration.prompt_words} words, {calibration.max_tokens} tokens): "
              f"TTFT {calibration.ttft_ms:.0f} ms, TPOT {calibration.tpot_ms:.1f} ms -> "
              f"SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms "
              f"(x{calibration.factors[0]:g}, x{calibration.factors[1]:g}); "
              f"reuse with --slo {slo.ttft_ms:g},{slo.tpot_ms:g}")
        if args.calibrate_only:
            return 0
    with report.progress(len(reqs), "requests", enabled=not args.no_progress) as advance:
        results = replay(reqs, prompts, cfg, on_done=advance)
    records = [r.as_dict() for r in results]
    summary = summarize_run(records, slo)
    label = args.label or ("poisson" if args.poisson is not None else "trace")
    _print_summary(label, summary)
    errors = [r for r in records if not r["ok"]]
    if errors:
        report.warn(f"{len(errors)} request(s) failed, first: {errors[0]['error']}")
    if args.json:
        report.write_json(args.json, benchmark="loadgen", args=vars(args) | {"func": None},
                          environment=envinfo.collect(), rows=[summary],
                          extra={"label": label, "summary": summary, "requests": records,
                                 "calibration": calibration.as_dict() if calibration else None})
    if args.plot:
        _plot(args.plot, {label: records})
    return 0 if not errors else 1
