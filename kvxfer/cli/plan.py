"""``kvxfer plan``: the best configuration of N accelerators for a trace and an SLO.

    kvxfer plan --trace T.jsonl --profile h100-llama2-7b-vidur --slo 2500,150 --gpus 16 \\
        --max-requests 1000 --json plan.json --plot plots/

Every configuration of ``--gpus`` workers (:func:`kvxfer.sim.configs.configs_for`: colocated,
each xPyD split, conditional and adaptive variants) runs on the virtual clock at the trace's
rate (``--time-scale``); the table is printed with the best by goodput (``kvxfer loadgen``'s:
requests per second meeting both SLOs). ``--rates`` adds, for the best ``--top`` of them, a
sweep of the request rate (time-scale divided by each factor), giving each one's
DistServe-style capacity: the highest rate at which at least ``--attainment`` of requests
meet the SLO; ``--plot DIR`` draws goodput and SLO attainment against the rate.
"""
from __future__ import annotations

import time

from .simulate import add_common, best_of, load_inputs, print_rows, run_config, write_json


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="sweep the configurations of N accelerators on the virtual clock",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--slo", required=True, metavar="TTFT_MS,TPOT_MS", help="SLO for goodput")
    p.add_argument("--gpus", type=int, required=True, help="accelerators (workers) to split")
    p.add_argument("--rates", default="0.5,1,1.5,2,3", metavar="X,...",
                   help="rate factors swept for the top configurations ('' : none)")
    p.add_argument("--top", type=int, default=4, help="configurations given the rate sweep")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="SLO attainment a rate must reach to count as served (DistServe: 0.9)")
    p.add_argument("--plot", metavar="DIR", help="write goodput/attainment-vs-rate PNGs here")
    p.set_defaults(func=run)


def _factors(text: str) -> list[float]:
    try:
        out = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--rates wants comma-separated numbers > 0, got {text!r}") from None
    if any(not f > 0 for f in out):
        raise ValueError(f"--rates wants numbers > 0, got {text!r}")
    return out


def capacity(points: list[dict], target: float) -> float:
    """The highest offered rate whose attainment reaches ``target`` (0.0 if none does);
    ``points`` are ``{"rate_rps", "slo_attainment"}``."""
    ok = [p["rate_rps"] for p in points if p["slo_attainment"] >= target]
    return max(ok) if ok else 0.0


def run(args) -> int:
    from ..sim.configs import configs_for

    began = time.perf_counter()
    try:
        names = configs_for(args.gpus)
        factors = _factors(args.rates)
        if not 0 < args.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    except ValueError as exc:
        raise SystemExit(f"kvxfer plan: {exc}") from None
    profile, slo, requests = load_inputs(args)
    span = requests[-1][0] - requests[0][0]
    base_rate = len(requests) / span if span > 0 else float("inf")
    try:
        rows = [run_config(name, args, profile, slo, requests) for name in names]
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvxfer plan: {exc}") from None
    for row in rows:
        row.pop("records")
    best = best_of(rows)
    print_rows(f"plan: {args.gpus} accelerators, {len(requests)} requests at "
               f"{base_rate:.2f} req/s, profile {profile.name}, SLO {args.slo}", rows, best)
    curves = {}
    if factors and span > 0:
        from argparse import Namespace

        from .simulate import arrivals

        top = sorted(rows, key=lambda r: -r["goodput_rps"])[:max(args.top, 1)]
        for row in top:
            points = []
            for f in factors:
                scaled = Namespace(**vars(args))
                reqs = arrivals(scaled, args.time_scale / f)
                out = run_config(row["name"], args, profile, slo, reqs)
                points.append({"rate_factor": f, "rate_rps": base_rate * f,
                               "goodput_rps": out["goodput_rps"],
                               "slo_attainment": out["slo_attainment"]})
            row["rate_sweep"] = points
            row["capacity_rps"] = capacity(points, args.attainment)
            curves[row["name"]] = points
        for name, points in curves.items():
            print(f"{name}: capacity {next(r for r in rows if r['name'] == name)['capacity_rps']:.2f}"
                  f" req/s at >= {100 * args.attainment:g}% SLO attainment; "
                  + ", ".join(f"x{p['rate_factor']:g} {100 * p['slo_attainment']:.0f}%" for p in points))
    elapsed = time.perf_counter() - began
    print(f"best: {best}; plan took {elapsed:.1f} s")
    if args.json:
        write_json(args.json, best, rows, {"profile": profile.name, "gpus": args.gpus,
                                           "slo": args.slo, "routing": args.routing,
                                           "num_requests": len(requests),
                                           "base_rate_rps": base_rate, "elapsed_s": elapsed})
    if args.plot and curves:
        _plot(args.plot, curves, args.attainment)
    return 0


def _plot(folder: str, curves: dict[str, list[dict]], target: float) -> None:
    import os

    try:
        import matplotlib
    except ImportError:
        raise SystemExit("kvxfer plan: --plot needs matplotlib (pip install 'kvxfer[sim]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    for key, label, fname in (("goodput_rps", "goodput (req/s)", "goodput_vs_rate.png"),
                              ("slo_attainment", "SLO attainment", "attainment_vs_rate.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, points in curves.items():
            ax.plot([p["rate_rps"] for p in points], [p[key] for p in points], marker="o",
                    label=name)
        if key == "slo_attainment":
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(folder, fname), dpi=120)
        plt.close(fig)
