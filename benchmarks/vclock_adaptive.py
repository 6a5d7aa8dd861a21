"""Adaptive rebalancing against every static split of 16 simulated GPUs, on a shifting mix.

    python benchmarks/vclock_adaptive.py --out benchmarks/results/vclock_adaptive.json

The trace is :mod:`shifting_trace`'s (a long-prompt phase, then a long-output phase;
``--seed``, phase lengths and rates as there), replayed on the virtual clock
(``kvxfer simulate``'s :func:`~kvxfer.sim.replay.run_config`) with every static split
``xP(16-x)D`` and with ``adaptive:xPyD`` from ``--adaptive-from`` starting splits and
from the best static one. Profile ``h100-llama2-7b-vidur``, 6,000 blocks a GPU, the
engine's default batch limits, SLO TTFT 2.5 s / TPOT 0.15 s (as
``benchmarks/vclock_scale.py``). Goodput is ``kvxfer loadgen``'s: requests meeting both
SLOs per second of the run. Every figure is virtual time: the machine's load does not
change it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shifting_trace  # noqa: E402
from vclock_scale import write_doc  # noqa: E402

SLO = "2500,150"
_SHARED: dict = {}


def _run(name: str) -> dict:
    from kvxfer.sim.replay import run_config

    args, profile, slo, requests = (_SHARED[k] for k in ("args", "profile", "slo", "requests"))
    t0 = time.perf_counter()
    row = run_config(name, args, profile, slo, requests)
    records = row.pop("records")
    split_s = _SHARED["split_s"]
    for phase, keep in (("prompt_phase", lambda r: r["sent_s"] < split_s),
                        ("output_phase", lambda r: r["sent_s"] >= split_s)):
        rs = [r for r in records if keep(r)]
        met = [r for r in rs if r.get("ok") and r["ttft_s"] <= slo.ttft_ms / 1e3
               and (r["tpot_s"] or 0.0) <= slo.tpot_ms / 1e3]
        row[f"{phase}_attainment"] = len(met) / len(rs) if rs else None
    row["wall_s"] = time.perf_counter() - t0
    print(f"{name:>16}: goodput {row['goodput_rps']:.2f} req/s, SLO met "
          f"{100 * row['slo_attainment']:.1f}% (prompt phase "
          f"{100 * row['prompt_phase_attainment']:.1f}%, output phase "
          f"{100 * row['output_phase_attainment']:.1f}%), moves "
          f"{ {k: v for k, v in row['counters'].items() if k.startswith('move_')} }", flush=True)
    return row


def main() -> int:
    from kvxfer.sim.replay import RunOptions, TraceSlice
    from kvxfer.loadgen.metrics import SLO as Slo
    from kvxfer.serving.simulated.profile import load_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=16)
    shifting_trace.add_arguments(ap)
    ap.add_argument("--adaptive-from", default="8P8D",
                    help="starting splits of the adaptive runs (the best static one is added)")
    ap.add_argument("--num-blocks", type=int, default=6000)
    ap.add_argument("--profile", default="h100-llama2-7b-vidur")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--statics-from", default=None, metavar="JSON",
                    help="take the static rows from this earlier --out of the same trace and "
                         "run the adaptive ones only (they do not depend on the policy)")
    args = ap.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "shifting.jsonl")
        rows = shifting_trace.generate(args)
        with open(trace, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        from kvxfer.serving.engine.config import EngineConfig

        options = RunOptions(num_blocks=args.num_blocks, max_num_seqs=EngineConfig.max_num_seqs,
                             max_num_batched_tokens=EngineConfig.max_num_batched_tokens)
        _SHARED.update(args=options, profile=load_profile(args.profile), slo=Slo.parse(SLO),
                       requests=TraceSlice(trace).arrivals(), split_s=args.prompt_phase_s)
    n = args.gpus
    statics = [f"{x}P{n - x}D" for x in range(1, n)]
    ctx = multiprocessing.get_context("fork")
    starts = [s for s in args.adaptive_from.split(",") if s]
    if args.statics_from:
        with open(args.statics_from) as f:
            earlier = json.load(f)
        if earlier["trace"]["num_requests"] != len(_SHARED["requests"]):
            raise SystemExit(f"{args.statics_from} is of another trace")
        static_rows = earlier["static"]
        best = max(static_rows, key=lambda r: r["goodput_rps"])
        if best["name"] not in starts:
            starts.append(best["name"])
        with ctx.Pool(args.jobs) as pool:
            adaptive_rows = pool.map(_run, [f"adaptive:{s}" for s in starts], chunksize=1)
    else:
        with ctx.Pool(args.jobs) as pool:  # the given adaptive starts first, then every split
            rows = pool.map(_run, [f"adaptive:{s}" for s in starts] + statics, chunksize=1)
            adaptive_rows, static_rows = rows[:len(starts)], rows[len(starts):]
            best = max(static_rows, key=lambda r: r["goodput_rps"])
            if best["name"] not in starts:  # and from the best static split
                adaptive_rows.append(_run(f"adaptive:{best['name']}"))
    best_adaptive = max(adaptive_rows, key=lambda r: r["goodput_rps"])
    ratio = best_adaptive["goodput_rps"] / best["goodput_rps"]
    print(f"best static {best['name']} {best['goodput_rps']:.2f} req/s; best adaptive "
          f"{best_adaptive['name']} {best_adaptive['goodput_rps']:.2f} req/s: {ratio:.3f}x")
    doc = {"command": "python benchmarks/vclock_adaptive.py " + " ".join(sys.argv[1:]),
           "trace": {"generator": "benchmarks/shifting_trace.py", "seed": args.seed,
                     "prompt_phase_s": args.prompt_phase_s, "prompt_rate": args.prompt_rate,
                     "output_phase_s": args.output_phase_s, "output_rate": args.output_rate,
                     "num_requests": len(_SHARED["requests"])},
           "slo": SLO, "profile": args.profile, "num_blocks": args.num_blocks,
           "best_static": best["name"], "best_adaptive": best_adaptive["name"],
           "adaptive_over_static": ratio, "elapsed_s": time.perf_counter() - began,
           "static": static_rows, "adaptive": adaptive_rows}
    write_doc(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
