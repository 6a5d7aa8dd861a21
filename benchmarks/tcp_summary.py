"""Summarize a ``benchmarks/tcp_netns.sh`` run: per-repetition ratios and their medians.

    python benchmarks/tcp_summary.py OUT_DIR [--json FILE]

Reads ``iperf3-<k>.json`` (one stream; k = 1..REPS+1, run between repetitions),
``iperf3p<N>-<k>.json`` (N streams, when kvxfer ran with N > 1 TCP lanes) and
``kvxfer-{small,large}-<rep>.json`` (``kvxfer bench transfer --json`` rows, with
``nixl_gbps`` when NIXL ran). Repetition ``rep``'s limit is the mean of the iperf3
runs just before (k = rep) and after (k = rep + 1) it. Prints a markdown table:
per block size the median kvxfer and NIXL GB/s, every repetition's kvxfer/iperf3
ratio (against -P N when it ran: as many streams as kvxfer's lanes), the median
against -P 1 too, and kvxfer/NIXL; then the iperf3 runs and the load.
"""
from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys


def _iperf(out: str, prefix: str = "iperf3") -> dict[int, float]:
    runs = {}
    for path in glob.glob(os.path.join(out, f"{prefix}-*.json")):
        k = int(re.search(r"-(\d+)\.json$", path).group(1))
        runs[k] = json.load(open(path))["end"]["sum_received"]["bits_per_second"] / 8e9
    return runs


def _streams(out: str) -> int:
    """N of the iperf3 -P N runs (1 when only single-stream runs are there)."""
    found = {int(m.group(1)) for p in glob.glob(os.path.join(out, "iperf3p*-*.json"))
             if (m := re.search(r"iperf3p(\d+)-\d+\.json$", p))}
    if len(found) > 1:
        raise ValueError(f"{out}: iperf3 runs with different stream counts {sorted(found)}")
    return found.pop() if found else 1


def _rows(out: str) -> dict[int, list[dict]]:
    reps: dict[int, list[dict]] = {}
    for path in glob.glob(os.path.join(out, "kvxfer-*-*.json")):
        rep = int(re.search(r"-(\d+)\.json$", path).group(1))
        reps.setdefault(rep, []).extend(json.load(open(path))["rows"])
    return reps


def summarize(out: str) -> dict:
    streams = _streams(out)
    iperf1, reps = _iperf(out), _rows(out)
    iperf = _iperf(out, f"iperf3p{streams}") if streams > 1 else iperf1
    sizes: dict[tuple, dict] = {}
    for rep, rows in sorted(reps.items()):
        if any(k not in runs for runs in (iperf, iperf1) for k in (rep, rep + 1)):
            continue
        limit = (iperf[rep] + iperf[rep + 1]) / 2
        limit1 = (iperf1[rep] + iperf1[rep + 1]) / 2
        for r in rows:
            s = sizes.setdefault((r["block_size"], r["batch"]), {
                "block": r["block"], "batch": r["batch"], "transport": r["transport"],
                "kvxfer_gbps": [], "nixl_gbps": [], "x_iperf3": [], "x_iperf3_p1": [], "x_nixl": [],
                "limit_gbps": [], "limit_p1_gbps": []})
            s["kvxfer_gbps"].append(r["gbps"])
            s["limit_gbps"].append(limit)
            s["limit_p1_gbps"].append(limit1)
            s["x_iperf3"].append(r["gbps"] / limit)
            s["x_iperf3_p1"].append(r["gbps"] / limit1)
            if r.get("nixl_gbps"):
                s["nixl_gbps"].append(r["nixl_gbps"])
                s["x_nixl"].append(r["gbps"] / r["nixl_gbps"])
    for s in sizes.values():
        for key in ("kvxfer_gbps", "nixl_gbps", "x_iperf3", "x_iperf3_p1", "x_nixl", "limit_gbps",
                    "limit_p1_gbps"):
            s[f"median_{key}"] = statistics.median(s[key]) if s[key] else None
    load = open(os.path.join(out, "load.txt")).read().splitlines() if os.path.exists(
        os.path.join(out, "load.txt")) else []
    return {"streams": streams, "iperf3_gbps": [iperf1[k] for k in sorted(iperf1)],
            "iperf3_pn_gbps": [iperf[k] for k in sorted(iperf)] if streams > 1 else [], "load": load,
            "rows": [sizes[k] for k in sorted(sizes)]}


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(summary: dict) -> str:
    n = summary.get("streams", 1)
    pn = f"iperf3 -P {n}"
    lines = [f"| block x batch | kvxfer GB/s (median) | NIXL GB/s (median) | iperf3 -P 1 GB/s | {pn} GB/s "
             f"| kvxfer/{pn} per rep | **median** | kvxfer/iperf3 -P 1 | kvxfer/NIXL per rep | **median** |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary["rows"]:
        lines.append(
            f"| {s['block']} x {s['batch']} | {_f(s['median_kvxfer_gbps'])} | {_f(s['median_nixl_gbps'])} "
            f"| {_f(s['median_limit_p1_gbps'])} | {_f(s['median_limit_gbps'])} "
            f"| {' '.join(_f(x) for x in s['x_iperf3'])} | **{_f(s['median_x_iperf3'])}** "
            f"| {_f(s['median_x_iperf3_p1'])} | {' '.join(_f(x) for x in s['x_nixl']) or '-'} "
            f"| **{_f(s['median_x_nixl'])}** |")
    lines.append("")
    lines.append("iperf3 -P 1 runs (GB/s, in order): " + " ".join(_f(x) for x in summary["iperf3_gbps"]))
    if summary.get("iperf3_pn_gbps"):
        lines.append(f"{pn} runs (GB/s, in order): " + " ".join(_f(x) for x in summary["iperf3_pn_gbps"]))
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
