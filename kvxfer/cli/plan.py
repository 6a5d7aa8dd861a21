"""``kvxfer plan``: the configuration and tensor-parallel degrees of at most N GPUs that
serve the highest request rate per GPU within an SLO (DistServe's placement search).

    kvxfer plan --trace T.jsonl --profile a100-opt13b-distserve --gpus 4 --tp 1,2,4 \\
        --slo 200,100 --attainment 0.9 --attainment-mode each --no-enable-chunked-prefill
    kvxfer plan --trace T.jsonl --profile a100-llama2-7b-vidur --gpus 8 --tp 1,2,4 \\
        --slo 2500,150 --max-requests 1000 --json plan.json --plot plots/

Every colocated configuration and split whose workers fit in ``--gpus`` GPUs
(``colocated:N@K``, ``xPyD@A,B``; :func:`kvxfer.sim.configs.placements`) is judged by its
capacity: the highest rate, the trace's arrivals scaled, at which ``--attainment`` of the
requests meet the SLO (``--attainment-mode both``: both SLOs by the same request;
``each``: each SLO by that share), found to within 5% by bisection; the table ranks
them by capacity per GPU (:mod:`kvxfer.sim.plan`). The search is pruned by default (a
branch and bound that picks what ``--exhaustive`` picks); then the conditional and
adaptive variants of the ``--variants`` best splits. ``--plot DIR`` draws attainment
against the per-GPU rate for the best configurations, as DistServe's Figure 8.
"""
from __future__ import annotations

import time

from .simulate import add_common, load_inputs, print_table, write_json


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the best configuration of N GPUs: capacity per GPU under SLOs",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--slo", required=True, metavar="TTFT_MS,TPOT_MS", help="the SLOs")
    p.add_argument("--gpus", type=int, required=True, help="GPUs at most")
    p.add_argument("--tp", default="1", metavar="K,...",
                   help="tensor-parallel degrees a worker may have (default 1)")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLOs (DistServe: 0.9)")
    p.add_argument("--attainment-mode", choices=("both", "each"), default="both",
                   help="both: the share meeting both SLOs (DistServe's paper); each: the "
                        "shares meeting TTFT and TPOT, each (DistServe's simulator)")
    p.add_argument("--config", action="append", default=[], metavar="CONFIG",
                   help="judge only these configurations (repeatable; default: every one that "
                        "fits --gpus at the --tp degrees)")
    p.add_argument("--exhaustive", action="store_true",
                   help="search every configuration in full, not the pruned search")
    p.add_argument("--variants", type=int, default=1, metavar="K",
                   help="the K best splits get conditional and adaptive variants")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="runs at once, one process each (default: the CPUs)")
    p.add_argument("--top", type=int, default=3, help="configurations --plot draws")
    p.add_argument("--plot", metavar="DIR", help="write attainment-vs-per-GPU-rate PNGs here")
    p.set_defaults(func=run)


def _tps(text: str) -> tuple[int, ...]:
    try:
        tps = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--tp wants comma-separated degrees, e.g. 1,2,4; got {text!r}") from None
    return tps


def run(args) -> int:
    import os

    from ..loadgen.metrics import SLO
    from ..sim.plan import Planner, PlanSpec, ProcessRunner, candidates
    from ..sim.vclock import prompt_hashes

    began = time.perf_counter()
    try:
        spec = PlanSpec(gpus=args.gpus, slo=SLO.parse(args.slo), tps=_tps(args.tp),
                        target=args.attainment, mode=args.attainment_mode,
                        variants=args.variants, exhaustive=args.exhaustive,
                        configs=tuple(args.config))
        runner = ProcessRunner(args.jobs if args.jobs is not None else (os.cpu_count() or 1))
    except ValueError as exc:
        raise SystemExit(f"kvxfer plan: {exc}") from None
    profile, _, _, options, requests = load_inputs(args)
    try:
        candidates(spec, profile)  # the profile's degrees, before any run
        planner = Planner(spec, profile, options, requests,
                          prompt_hashes(requests, profile.block_size), runner)
        runner.bind(planner)
        doc = planner.plan()
        curves = planner.best_curves(doc, args.top) if args.plot else {}
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvxfer plan: {exc}") from None
    finally:
        runner.close()
    elapsed = time.perf_counter() - began
    _print(args, spec, profile, planner, doc, elapsed)
    if args.json:
        write_json(args.json, doc["best"], doc["configs"], {
            "best_per_gpu_rate_rps": doc["best_per_gpu_rate_rps"], "profile": profile.name,
            "gpus": args.gpus, "tp": list(spec.tps), "slo": args.slo,
            "attainment": args.attainment, "attainment_mode": args.attainment_mode,
            "chunked_prefill": args.chunked_prefill, "routing": args.routing,
            "num_requests": len(requests), "trace_rate_rps": planner.base_rate,
            "exhaustive": args.exhaustive, "runs": doc["runs"], "jobs": runner.jobs,
            "elapsed_s": elapsed, "curves": curves})
    if args.plot and curves:
        _plot(args.plot, curves, args.attainment, args.attainment_mode)
    return 0


def _print(args, spec, profile, planner, doc, elapsed: float) -> None:
    def fmt(v, form):
        return "-" if v is None else format(v, form)

    rows = sorted(doc["configs"], key=lambda r: (-(r["per_gpu_rate_rps"] or 0), r["gpus"]))
    table = [{"config": r["name"] + (" *" if r["name"] == doc["best"] else ""),
              "gpus": str(r["gpus"]), "rate": fmt(r["max_rate_rps"], ".2f"),
              "per_gpu": fmt(r["per_gpu_rate_rps"], ".3f")
              if not r["pruned"] else f"< {r['below_per_gpu_rate_rps']:.3f}",
              "runs": str(len(r["probes"]))} for r in rows]
    cols = [("config", "config"), ("GPUs", "gpus"), ("max req/s", "rate"),
            ("req/s per GPU", "per_gpu"), ("runs", "runs")]
    print_table(f"plan: at most {spec.gpus} GPUs, TP {','.join(map(str, spec.tps))}, "
                f"{len(planner.requests)} requests, profile {profile.name}, SLO {args.slo} met by "
                f"{100 * spec.target:g}% ({spec.mode}), "
                f"{'chunked prefill' if args.chunked_prefill else 'whole prompts first'}",
                cols, table, f"best: {doc['best']}")
    best = ("none meets the SLO at any rate" if doc["best"] is None else
            f"{doc['best']} at {doc['best_per_gpu_rate_rps']:.3f} req/s per GPU")
    print(f"best: {best}; plan took {elapsed:.1f} s ({doc['runs']} virtual-clock runs, "
          f"{planner.runner.jobs} at a time)")


def _plot(folder: str, curves: dict[str, list[dict]], target: float, mode: str) -> None:
    import os

    try:
        import matplotlib
    except ImportError:
        raise SystemExit("kvxfer plan: --plot needs matplotlib (pip install 'kvxfer[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([p["per_gpu_rate_rps"] for p in points], [100 * p["attainment"] for p in points],
                marker="o", label=name)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate per GPU (req/s)")
    ax.set_ylabel(f"SLO attainment, {mode} (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "attainment_vs_per_gpu_rate.png"), dpi=120)
    plt.close(fig)
