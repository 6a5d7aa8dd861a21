"""When disaggregation pays: capacity per GPU of colocated and split serving at four SLO
corners, on the ShareGPT lengths and on the Mooncake conversation trace.

    python benchmarks/plan_slo_corners.py --out benchmarks/results/plan_slo_corners.json \
        --plot docs/plots/slo_corners.png
    python benchmarks/plan_slo_corners.py --replot benchmarks/results/plan_slo_corners.json \
        --plot docs/plots/slo_corners.png        # the figure again from the results

For each trace and each corner (tight or loose TTFT x tight or loose TPOT), ``kvxfer plan``
(:class:`kvxfer.sim.plan.Planner`, pruned search, 90% of requests meeting both SLOs) over
at most ``--gpus`` A100s with tensor-parallel degrees 1, 2 and 4 finds the best of three
families: colocated workers with chunked prefill (vLLM's default today), colocated workers
running whole prompts first (``--no-enable-chunked-prefill``, vLLM before chunked prefill),
and prefill/decode splits (``xPyD@A,B``, prefill workers batching whole prompts). Profile
``a100-llama3-8b-vidur`` on both traces (its KV, 128 KiB a token, holds Mooncake's long
prompts). The SLO values, per trace, are multiples of what one request costs alone on
one GPU (``CORNERS``). Every figure is virtual time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "benchmarks", "traces")
PROFILE = "a100-llama3-8b-vidur"
# trace -> (file, requests, arrival jitter ms, {corner: (TTFT ms, TPOT ms)}). ShareGPT's
# prompts take 54 ms alone on one A100 at the median (120 ms at p90) and a decode step of
# one request ~10 ms: TTFT tight 250 ms (DistServe's chatbot SLO for OPT-13B, ~2x p90),
# loose 2.5 s; TPOT tight 25 ms (2.5x a lone step), loose 100 ms (DistServe's chatbot).
# Mooncake's prompts take 0.9 s alone at the median (6.2 s at p90, 1.7 s on 4 GPUs): TTFT
# tight 5 s, loose 25 s; the same TPOTs. Mooncake's timestamps are 3 s buckets: each
# arrival is spread within its bucket (seed 0), as kvxfer loadgen --arrival-jitter-ms does.
CORNERS = {
    "sharegpt": ("sharegpt_opt13b_distserve.jsonl", 1000, 0.0,
                 {"tight TTFT, tight TPOT": (250, 25), "tight TTFT, loose TPOT": (250, 100),
                  "loose TTFT, tight TPOT": (2500, 25), "loose TTFT, loose TPOT": (2500, 100)}),
    "mooncake": ("mooncake_conversation_1000.jsonl", 1000, 3000.0,
                 {"tight TTFT, tight TPOT": (5000, 25), "tight TTFT, loose TPOT": (5000, 100),
                  "loose TTFT, tight TPOT": (25000, 25), "loose TTFT, loose TPOT": (25000, 100)}),
}
FAMILIES = (("colocated, chunked prefill", "colocated", True),
            ("colocated, whole prompts first", "colocated", False),
            ("split", "split", False))


def best_of_family(requests, hashes, profile, slo, gpus: int, mode: str, chunked: bool,
                   jobs: int) -> dict:
    from kvxfer.sim.configs import placements
    from kvxfer.sim.plan import Planner, PlanSpec, ProcessRunner
    from kvxfer.sim.replay import RunOptions

    spec = PlanSpec(gpus=gpus, slo=slo, tps=(1, 2, 4), variants=0,
                    configs=tuple(placements(gpus, (1, 2, 4), [mode])))
    runner = ProcessRunner(jobs)
    began = time.perf_counter()
    try:
        planner = Planner(spec, profile, RunOptions(chunked_prefill=chunked), requests, hashes,
                          runner)
        runner.bind(planner)
        doc = planner.plan()
    finally:
        runner.close()
    return {"best": doc["best"], "per_gpu_rate_rps": doc["best_per_gpu_rate_rps"] or 0.0,
            "runs": doc["runs"], "elapsed_s": time.perf_counter() - began,
            "infeasible": sum(1 for c in doc["configs"] if c["infeasible"]),
            "configs": len(doc["configs"])}


def main() -> int:
    from kvxfer.loadgen.metrics import SLO
    from kvxfer.serving.simulated.profile import load_profile
    from kvxfer.sim.replay import TraceSlice
    from kvxfer.sim.vclock import prompt_hashes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--traces", default="sharegpt,mooncake")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="draw --plot from this results file instead of running")
    args = ap.parse_args()
    if args.replot:
        if not args.plot:
            ap.error("--replot needs --plot")
        with open(args.replot) as f:
            plot(json.load(f)["rows"], args.plot)
        return 0
    profile = load_profile(PROFILE)
    began, rows = time.perf_counter(), []
    for trace in args.traces.split(","):
        path, n, jitter, corners = CORNERS[trace]
        requests = TraceSlice(os.path.join(TRACES, path), max_requests=n, jitter_ms=jitter).arrivals()
        hashes = prompt_hashes(requests, profile.block_size)
        for corner, (ttft, tpot) in corners.items():
            row = {"trace": trace, "corner": corner, "slo_ms": [ttft, tpot], "families": {}}
            for family, mode, chunked in FAMILIES:
                out = best_of_family(requests, hashes, profile, SLO(ttft, tpot), args.gpus, mode,
                                     chunked, args.jobs)
                row["families"][family] = out
                print(f"{trace:>8} {corner:>22} ({ttft}/{tpot} ms) {family:>30}: "
                      f"{out['best']} {out['per_gpu_rate_rps']:.3f} req/s per GPU "
                      f"({out['runs']} runs, {out['elapsed_s']:.0f} s)", flush=True)
            fams = row["families"]
            row["winner"] = max(fams, key=lambda f: fams[f]["per_gpu_rate_rps"])
            col = max(fams[f]["per_gpu_rate_rps"] for f in fams if f.startswith("colocated"))
            row["split_over_colocated"] = (fams["split"]["per_gpu_rate_rps"] / col) if col else None
            rows.append(row)
    doc = {"command": "python benchmarks/plan_slo_corners.py " + " ".join(sys.argv[1:]),
           "profile": PROFILE, "gpus": args.gpus, "tp": [1, 2, 4], "attainment": 0.9,
           "attainment_mode": "both", "elapsed_s": time.perf_counter() - began, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        these = [r for r in rows if r["trace"] == trace]
        width = 0.8 / len(FAMILIES)
        for j, (family, _, _) in enumerate(FAMILIES):
            xs = [i + (j - 1) * width for i in range(len(these))]
            bars = ax.bar(xs, [r["families"][family]["per_gpu_rate_rps"] for r in these], width,
                          label=family)
            for bar, r in zip(bars, these):  # the family's best configuration, TP included
                ax.annotate(r["families"][family]["best"] or "none",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", rotation=90, fontsize=6,
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(these)))
        ax.set_xticklabels([f"{r['corner'].replace(', ', chr(10))}\n{r['slo_ms'][0]}/{r['slo_ms'][1]} ms"
                            for r in these], fontsize=7)
        ax.set_ylabel("capacity per GPU (req/s), 90% meet both SLOs")
        ax.set_title(f"{trace}, {PROFILE}, <= 8 GPUs")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(0, 1.3 * max(r["families"][f]["per_gpu_rate_rps"] for r in these
                                 for f, _, _ in FAMILIES))
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
