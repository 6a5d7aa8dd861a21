"""Per-repetition table of serving runs against the colocated run of the same repetition.

    python benchmarks/diagnostics/serving_reps.py 723,91 /tmp/serve_r1 /tmp/serve_r2 /tmp/serve_r3

Each directory holds one repetition's ``<label>.json`` files from
``benchmarks/serving_compare.sh``; the first label is the baseline. Prints Markdown rows:
goodput, SLO attainment, goodput ratio, TTFT/TPOT p50/p99 and the TPOT p99 ratio.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvxfer.loadgen.metrics import SLO, summarize_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("slo", help="TTFT_MS,TPOT_MS")
    ap.add_argument("dirs", nargs="+", help="one directory per repetition")
    ap.add_argument("--labels", default="colocated-mixed,disagg,disagg-conditional")
    args = ap.parse_args()
    slo = SLO.parse(args.slo)
    labels = args.labels.split(",")
    runs = {label: [] for label in labels}
    for d in args.dirs:
        for label in labels:
            recs = json.loads((Path(d) / f"{label}.json").read_text())["requests"]
            runs[label].append(summarize_run(recs, slo))
    base = runs[labels[0]]
    for label in labels:
        for i, s in enumerate(runs[label]):
            b = base[i]
            print(f"| {label} rep {i + 1} | {s['goodput']:.3f} | {100 * s['slo_attainment']:.0f}% | "
                  f"{s['goodput'] / b['goodput']:.2f}x | {s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} | "
                  f"{s['tpot_ms']['median']:.0f} / {s['tpot_ms']['p99']:.0f} | "
                  f"{s['tpot_ms']['p99'] / b['tpot_ms']['p99']:.2f}x |")


if __name__ == "__main__":
    main()
