"""Summarize a ``benchmarks/tcp_netns.sh`` run: per-repetition ratios and their medians.

    python benchmarks/tcp_summary.py OUT_DIR [--json FILE]

Reads ``iperf3-<k>.json`` (k = 1..REPS+1, run between repetitions) and
``kvxfer-{small,large}-<rep>.json`` (``kvxfer bench transfer --json`` rows, with
``nixl_gbps`` when NIXL ran). Repetition ``rep``'s limit is the mean of the iperf3
runs just before (k = rep) and after (k = rep + 1) it. Prints a markdown table:
per block size the median kvxfer and NIXL GB/s, every repetition's kvxfer/iperf3
and kvxfer/NIXL ratio, and their medians; then the iperf3 runs and the load.
"""
from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys


def _iperf(out: str) -> dict[int, float]:
    runs = {}
    for path in glob.glob(os.path.join(out, "iperf3-*.json")):
        k = int(re.search(r"iperf3-(\d+)\.json$", path).group(1))
        runs[k] = json.load(open(path))["end"]["sum_received"]["bits_per_second"] / 8e9
    return runs


def _rows(out: str) -> dict[int, list[dict]]:
    reps: dict[int, list[dict]] = {}
    for path in glob.glob(os.path.join(out, "kvxfer-*-*.json")):
        rep = int(re.search(r"-(\d+)\.json$", path).group(1))
        reps.setdefault(rep, []).extend(json.load(open(path))["rows"])
    return reps


def summarize(out: str) -> dict:
    iperf, reps = _iperf(out), _rows(out)
    sizes: dict[tuple, dict] = {}
    for rep, rows in sorted(reps.items()):
        if rep not in iperf or rep + 1 not in iperf:
            continue
        limit = (iperf[rep] + iperf[rep + 1]) / 2
        for r in rows:
            s = sizes.setdefault((r["block_size"], r["batch"]), {
                "block": r["block"], "batch": r["batch"], "transport": r["transport"],
                "kvxfer_gbps": [], "nixl_gbps": [], "x_iperf3": [], "x_nixl": [], "limit_gbps": []})
            s["kvxfer_gbps"].append(r["gbps"])
            s["limit_gbps"].append(limit)
            s["x_iperf3"].append(r["gbps"] / limit)
            if r.get("nixl_gbps"):
                s["nixl_gbps"].append(r["nixl_gbps"])
                s["x_nixl"].append(r["gbps"] / r["nixl_gbps"])
    for s in sizes.values():
        for key in ("kvxfer_gbps", "nixl_gbps", "x_iperf3", "x_nixl", "limit_gbps"):
            s[f"median_{key}"] = statistics.median(s[key]) if s[key] else None
    load = open(os.path.join(out, "load.txt")).read().splitlines() if os.path.exists(
        os.path.join(out, "load.txt")) else []
    return {"iperf3_gbps": [iperf[k] for k in sorted(iperf)], "load": load,
            "rows": [sizes[k] for k in sorted(sizes)]}


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(summary: dict) -> str:
    lines = ["| block x batch | kvxfer GB/s (median) | NIXL GB/s (median) | iperf3 GB/s (median) "
             "| kvxfer/iperf3 per rep | **median** | kvxfer/NIXL per rep | **median** |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary["rows"]:
        lines.append(
            f"| {s['block']} x {s['batch']} | {_f(s['median_kvxfer_gbps'])} | {_f(s['median_nixl_gbps'])} "
            f"| {_f(s['median_limit_gbps'])} | {' '.join(_f(x) for x in s['x_iperf3'])} "
            f"| **{_f(s['median_x_iperf3'])}** | {' '.join(_f(x) for x in s['x_nixl']) or '-'} "
            f"| **{_f(s['median_x_nixl'])}** |")
    lines.append("")
    lines.append("iperf3 runs (GB/s, in order): " + " ".join(_f(x) for x in summary["iperf3_gbps"]))
    lines.append("load (1/5/15 min) at each repetition start and at the end: " + "; ".join(summary["load"]))
    transports = sorted({s["transport"] for s in summary["rows"]})
    lines.append("kvxfer transport: " + ", ".join(transports))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    summary = summarize(argv[0])
    if len(argv) >= 3 and argv[1] == "--json":
        with open(argv[2], "w") as f:
            json.dump(summary, f, indent=1)
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
