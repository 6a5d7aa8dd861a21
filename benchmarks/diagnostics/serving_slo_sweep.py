"""SLO attainment of `kvxfer loadgen` result files under several SLO definitions.

Re-scores recorded requests (no new runs): a fixed TTFT SLO, or one scaled with the
prompt (``TTFT_MS * max(1, words / WORDS)``: a prompt longer than the calibration
request may take proportionally longer), each with several TPOT SLOs. Used to ask
whether any reasonable SLO would separate the serving modes of one run.

    python benchmarks/diagnostics/serving_slo_sweep.py --ttft-ms 723 --words 255 --tpot-ms 91,68,57 \\
        benchmarks/results/serving_compare_*.json
"""
from __future__ import annotations

import argparse
import json


def attainment(requests: list, ttft_ms, tpot_ms: float) -> float:
    """Fraction of ``requests`` whose TTFT and TPOT meet the SLO (failed requests miss it)."""
    met = 0
    for r in requests:
        if r.get("ok") and r["ttft_s"] * 1e3 <= ttft_ms(r["input_words"]) and (r["tpot_s"] or 0) * 1e3 <= tpot_ms:
            met += 1
    return met / len(requests) if requests else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="kvxfer loadgen --json result files, or files of several "
                    "such runs ({\"runs\": {name: result}}, as benchmarks/results/serving_compare.json)")
    ap.add_argument("--ttft-ms", type=float, required=True)
    ap.add_argument("--words", type=float, required=True, help="prompt words of the calibration request")
    ap.add_argument("--tpot-ms", default="91", help="comma-separated TPOT SLOs")
    args = ap.parse_args(argv)
    tpots = [float(x) for x in args.tpot_ms.split(",")]
    rules = {"fixed": lambda w: args.ttft_ms, "scaled": lambda w: args.ttft_ms * max(1.0, w / args.words)}
    cols = [(name, tp) for name in rules for tp in tpots]
    print("file | " + " | ".join(f"{name} TTFT, TPOT {tp:g}" for name, tp in cols))
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        runs = data["runs"] if "runs" in data else {path: data}
        for name, run in runs.items():
            reqs = run["requests"]
            print(f"{name} | " + " | ".join(f"{attainment(reqs, rules[n], tp):.0%}" for n, tp in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
