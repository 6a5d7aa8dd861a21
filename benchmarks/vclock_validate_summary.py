"""The virtual clock against the mean of several wall-clock runs, per configuration and routing.

Each ``benchmarks/vclock_validate.py`` run scores one wall-clock run of each configuration
against the virtual clock, which is deterministic; on a shared 2-core host the wall-clock
run's own goodput moves by several percent between runs. This reads any number of those
JSON files and prints, per ``(config, routing)``, the virtual clock's goodput and SLO
attainment against the mean of the wall-clock runs, with each run's ratio::

    python benchmarks/vclock_validate_summary.py benchmarks/results/vclock_validate_x8_epyc.json \\
        benchmarks/results/vclock_validate_reps/x8_epyc_*.json benchmarks/results/vclock_validate_reps/x8_kv_rep*.json

Files whose runs differ in anything but the port and output paths (slice, profile, SLO,
dilation, engine flags) are refused: their virtual clocks would not be the same.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

_MAY_DIFFER = ("configs", "port", "out", "slice", "profile", "routing", "vclock_only")  # between files


def summarize(paths: list) -> list:
    """One row per ``(config, routing)``: runs, the virtual clock's goodput and attainment,
    the wall-clock means, their ratios, and each run's goodput ratio."""
    runs, setup = defaultdict(list), None
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        args = {k: v for k, v in d["args"].items() if k not in _MAY_DIFFER}
        if setup is None:
            setup = (path, args)
        elif args != setup[1]:
            diff = sorted(k for k in set(args) | set(setup[1]) if args.get(k) != setup[1].get(k))
            raise SystemExit(f"{path} differs from {setup[0]} in {diff}")
        for c in d["configs"]:
            runs[(c["config"], d["args"]["routing"])].append(c)
    rows = []
    for (config, routing), cs in runs.items():
        vg, va = cs[0]["vclock"]["goodput_rps"], cs[0]["vclock"]["slo_attainment"]
        if any(abs(c["vclock"]["goodput_rps"] - vg) > 1e-9 for c in cs):
            raise SystemExit(f"{config} ({routing}): the virtual clock differs between files")
        wg = sum(c["wall"]["summary"]["goodput"] for c in cs) / len(cs)
        wa = sum(c["wall"]["summary"]["slo_attainment"] for c in cs) / len(cs)
        rows.append({"config": config, "routing": routing, "runs": len(cs), "vclock_goodput": vg,
                     "wall_goodput_mean": wg, "goodput_ratio": vg / wg, "vclock_attainment": va,
                     "wall_attainment_mean": wa, "attainment_ratio": va / wa if wa else float("nan"),
                     "run_goodput_ratios": [c["goodput_ratio"] for c in cs]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = summarize(args.files)
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["run_goodput_ratios"])
        print(f"{r['config']:18s} {r['routing']:12s} {r['runs']} runs: goodput {r['vclock_goodput']:.3f} / "
              f"{r['wall_goodput_mean']:.3f} = {r['goodput_ratio']:.3f}x, attainment {r['vclock_attainment']:.3f} / "
              f"{r['wall_attainment_mean']:.3f} = {r['attainment_ratio']:.3f}x (each run: {each})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": args.files, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
