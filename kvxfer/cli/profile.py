"""``kvxfer profile``: measure the embedded engine's step times and fit a cost profile.

    kvxfer profile --out my-cpu.json [--threads 1] [--repeats 3] [--model PATH.gguf]
    kvxfer profile --list               # shipped profiles, one name a line
    kvxfer profile --show NAME|FILE     # a profile's fit and residuals
    kvxfer profile --refit FILE [--hold TERM]   # fit FILE's measured points again, in place
    kvxfer profile --from-steps LOG [LOG ...] --out FILE.json
                                        # fit steps real workers logged while serving
                                        # (kvxfer serve --step-log DIR)
    kvxfer profile --from-distserve FILE --model NAME --out FILE.json
                                        # one model of DistServe's published fits
                                        # (profiler-*.json; max_num_tokens.csv beside it)

The profile feeds the simulated engine: ``kvxfer serve --engine sim --profile NAME|FILE``.
"""
from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure step times, fit the simulator's cost model",
                       description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print the shipped profiles' names")
    p.add_argument("--show", metavar="NAME|FILE", help="print a profile's fit and residuals")
    p.add_argument("--out", metavar="FILE.json",
                   help="write the profile: this machine timed on the grid, or --from-steps")
    p.add_argument("--refit", metavar="FILE.json",
                   help="fit the file's measured points again with this version's cost model")
    p.add_argument("--from-steps", nargs="+", default=None, metavar="LOG",
                   help="with --out: fit the step logs of real workers (kvxfer serve --step-log "
                        "DIR writes DIR/NAME.jsonl) instead of timing the grid")
    p.add_argument("--from-distserve", default=None, metavar="FILE",
                   help="with --out and --model: import one model of a DistServe profiler file "
                        "(e.g. kvxfer/serving/simulated/profiles/distserve/profiler-a100-80g.distserve.json)")
    p.add_argument("--max-num-tokens", default=None, metavar="CSV",
                   help="--from-distserve: its KV capacities (default: max_num_tokens.csv beside FILE)")
    p.add_argument("--distserve-engine", default=None, choices=("distserve", "vllm"),
                   help="--from-distserve: which engine the file profiles (default: from its name)")
    p.add_argument("--hold", nargs="*", default=[], metavar="TERM",
                   help="--refit: keep these terms at 0 (data that cannot tell them)")
    p.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    p.add_argument("--model", default=None, metavar="PATH.gguf|NAME",
                   help="Llama-family GGUF (default: the embedded SmolLM2-135M-Instruct); with "
                        "--from-distserve the model's name in the file (e.g. facebook/opt-13b)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (as a worker's --threads)")
    p.add_argument("--cpus", default=None, metavar="LIST", help="pin to these CPUs first, e.g. 0")
    p.add_argument("--matmul-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--repeats", type=int, default=3, help="timings per step (median kept)")
    p.add_argument("--link", default=None, metavar="BYTES_PER_S,LATENCY_S",
                   help="the P/D link to record (default: kvxfer's measured same-host vm "
                        "transfer, docs/benchmarks.md)")
    p.set_defaults(func=run)


# docs/benchmarks.md, "End to end": `kvxfer bench e2e --model smollm2-135m --rtt-iters 300`,
# 47.2 MB in 9.1 ms median (5.17 GB/s), 1-block round trip p50 193 us, transport vm.
SAME_HOST_LINK = (5.17e9, 193e-6, "kvxfer bench e2e --model smollm2-135m --rtt-iters 300 "
                  "(docs/benchmarks.md, End to end): 5.17 GB/s median, 1-block p50 193 us, "
                  "transport vm, same host")


def run(args: argparse.Namespace) -> int:
    from kvxfer.serving.simulated.profile import ProfileError, load_profile, shipped_profiles

    if args.list:
        for name in shipped_profiles():
            print(name)
        return 0
    if args.show:
        try:
            prof = load_profile(args.show)
        except ProfileError as exc:
            raise SystemExit(f"kvxfer profile: {exc}") from None
        print(json.dumps({k: v for k, v in prof.as_dict().items() if k != "points"}, indent=1))
        print(f"{len(prof.points)} measured points")
        return 0
    if args.refit:
        return _refit(args.refit, args.hold)
    if not args.out:
        raise SystemExit("kvxfer profile: give --out FILE.json, --list, --show NAME or --refit FILE")
    if args.from_steps:
        return _from_steps(args)
    if args.from_distserve:
        return _from_distserve(args)
    return _measure(args)


def _link(args: argparse.Namespace):
    from kvxfer.serving.simulated.link import Link

    if not args.link:
        return Link(*SAME_HOST_LINK)
    try:
        bw, lat = (float(v) for v in args.link.split(","))
    except ValueError:
        raise SystemExit(f"kvxfer profile: --link: expected BYTES_PER_S,LATENCY_S, "
                         f"got {args.link!r}") from None
    return Link(bw, lat, "given with --link")


def _from_distserve(args: argparse.Namespace) -> int:
    import sys
    from dataclasses import replace

    from kvxfer.sim.distserve import profile_from_distserve
    from kvxfer.serving.simulated.profile import ProfileError

    if not args.model:
        raise SystemExit("kvxfer profile: --from-distserve needs --model NAME (e.g. facebook/opt-13b)")
    try:
        prof = profile_from_distserve(args.from_distserve, args.model,
                                      capacity_path=args.max_num_tokens,
                                      engine=args.distserve_engine, name=args.name)
    except ProfileError as exc:
        raise SystemExit(f"kvxfer profile: {exc}") from None
    prof = replace(prof, command="kvxfer profile " + " ".join(sys.argv[2:]))
    prof.save(args.out)
    print(f"wrote {args.out}: {prof.name}, tensor-parallel degrees "
          f"{', '.join(map(str, prof.tp_degrees))}, {prof.engine['name']}")
    return 0


def _from_steps(args: argparse.Namespace) -> int:
    """Fit the steps real workers logged while serving; the logs must agree on the model,
    its KV bytes and block size, and come from the real engine."""
    import os
    import sys

    from kvxfer.serving.engine.step_log import read_step_log
    from kvxfer.serving.simulated.cost_model import StepCostModel
    from kvxfer.serving.simulated.profile import Profile, residuals

    points, headers = [], []
    for path in args.from_steps:
        try:
            header, got = read_step_log(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"kvxfer profile: {exc}") from None
        if header.get("engine") != "real":
            raise SystemExit(f"kvxfer profile: {path}: not a real engine's step log "
                             f"(engine {header.get('engine')!r})")
        headers.append(header)
        points += got
    same = {k: {h.get(k) for h in headers} for k in ("model", "block_size", "kv_bytes_per_token",
                                                      "matmul")}
    differ = {k: sorted(map(str, v)) for k, v in same.items() if len(v) != 1}
    if differ:
        raise SystemExit(f"kvxfer profile: the logs differ in {', '.join(differ)}: {differ}")
    head = headers[0]
    loads = [h.get("load_average", float("nan")) for h in headers]
    threads = sorted({h.get("threads") for h in headers}, key=str)
    machines = sorted({str(h.get("hardware", "unknown CPU")) for h in headers})
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    try:
        fit = StepCostModel.fit([(p["chunks"], p["seconds"]) for p in points])
        hardware = (f"{' / '.join(machines)}; {'/'.join(map(str, threads))} torch thread(s) a "
                    f"worker; {len(headers)} serving workers; load average "
                    f"{min(loads):.2f}-{max(loads):.2f} at their start")
        prof = Profile(
            name=name, hardware=hardware,
            model=head.get("model", ""), dtype=f"fp32 KV, {head.get('matmul')} matmul",
            block_size=head.get("block_size"), kv_bytes_per_token=head.get("kv_bytes_per_token"),
            fit=fit, link=_link(args), points=tuple(points), residuals=residuals(fit, points),
            source="step logs of real workers while serving (kvxfer serve --step-log), fitted "
                   "by kvxfer profile --from-steps",
            licence="", command="kvxfer profile " + " ".join(sys.argv[2:]))
    except ValueError as exc:
        raise SystemExit(f"kvxfer profile: {exc}") from None
    prof.save(args.out)
    res = prof.residuals["all"]
    print(f"wrote {args.out}: {len(points)} steps from {len(headers)} logs, fit {fit.as_dict()}; "
          f"relative error median {100 * res['median_abs']:.1f}%, max {100 * res['max_abs']:.1f}%")
    return 0


def _refit(path: str, hold: list[str]) -> int:
    """Fit the file's points again; every other field is kept (the fit of an older
    version's cost model need not parse)."""
    from kvxfer.serving.simulated.cost_model import TERMS, StepCostModel
    from kvxfer.serving.simulated.profile import Profile, ProfileError, residuals

    try:
        with open(path) as f:
            raw = json.load(f)
        raw["fit"] = dict.fromkeys(TERMS, 0.0)
        prof = Profile.from_dict(raw, path)
        fit = StepCostModel.fit([(p["chunks"], p["seconds"]) for p in prof.points],
                                terms=[t for t in TERMS if t not in hold])
    except (OSError, json.JSONDecodeError, ProfileError, ValueError) as exc:
        raise SystemExit(f"kvxfer profile: {exc}") from None
    raw.update(fit=fit.as_dict(), residuals=residuals(fit, prof.points))
    with open(path, "w") as f:
        json.dump(raw, f, indent=1)
        f.write("\n")
    print(f"refitted {path}: {fit.as_dict()}; residuals {raw['residuals']['all']}")
    return 0


def _measure(args: argparse.Namespace) -> int:
    import os
    import sys

    from kvxfer.serving.engine.config import EngineConfig
    from kvxfer.serving.engine.runtime import Runtime
    from kvxfer.serving.workers.main import pin_threads, runtime_model_name
    from kvxfer.serving.simulated.cost_model import StepCostModel
    from kvxfer.serving.simulated.measure import blocks_needed, cpu_name, measure
    from kvxfer.serving.simulated.profile import Profile, residuals

    pin_threads(args.cpus, args.threads)
    link = _link(args)
    block_size = EngineConfig.block_size
    runtime = Runtime.load(EngineConfig(model_path=args.model, num_blocks=blocks_needed(block_size),
                                        num_threads=args.threads, matmul_dtype=args.matmul_dtype))
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}; matmul {runtime.model.matmul_dtype}; "
          f"{args.threads} thread(s)", file=sys.stderr)

    def show(point):
        print(f"{point['kind']:8s} {len(point['chunks']):3d} chunks "
              f"{sum(n for n, _ in point['chunks']):5d} tokens: {point['seconds'] * 1e3:9.1f} ms",
              file=sys.stderr)

    points = measure(runtime.model, block_size, args.repeats, on_point=show)
    fit = StepCostModel.fit([(p["chunks"], p["seconds"]) for p in points])
    cache = runtime.cache
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    prof = Profile(name=name, hardware=f"{cpu_name()}; {args.threads} torch thread(s); "
                                        f"load average {load:.2f} at start",
                   model=runtime_model_name(args.model), dtype=f"fp32 KV, {runtime.model.matmul_dtype} "
                                                               f"matmul", block_size=block_size,
                   kv_bytes_per_token=cache.bytes_per_block // block_size, fit=fit, link=link,
                   points=tuple(points), residuals=residuals(fit, points),
                   source="measured by kvxfer profile on this machine", licence="",
                   command="kvxfer profile " + " ".join(sys.argv[2:]))
    prof.save(args.out)
    res = prof.residuals["all"]
    print(f"wrote {args.out}: {len(points)} points, fit {fit.as_dict()}; relative error median "
          f"{100 * res['median_abs']:.1f}%, max {100 * res['max_abs']:.1f}%")
    return 0
