"""Summarize a ``gpu_check.sh`` run: step exit codes, the figures, PASS/FAIL per target.

``python benchmarks/gpu/summary.py WORKDIR cuda|cpu OUTDIR`` reads ``steps.tsv``,
``pack.json``, ``overhead.json`` and ``transfer*.json`` from WORKDIR, prints the
text summary and writes ``OUTDIR/summary.json``; exits 1 if a step or a target failed.
In ``cpu`` mode the rate targets are reported, not judged (host pools, tiny shapes).

Transfer targets: the one-launch peer copy (``cuda_peer``) at >= 0.7x a device-to-device
copy of the same bytes (>= 0.7x ``cudaMemcpyPeer`` where D is on another GPU), bitwise,
with the transport named ``cuda_peer``; every other phase bitwise, its rate reported
beside the contiguous UCX put (``contig``) of the same bytes.
"""
from __future__ import annotations

import json
import os
import sys

PACK_TARGETS = {"Llama-3-8B": 0.85, "SmolLM2-135M": 0.6}
TRANSFER_TARGET = 0.7
OVERHEAD_US = 20.0


def _load(outdir: str, name: str):
    try:
        with open(os.path.join(outdir, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main() -> int:
    outdir, mode, dest = sys.argv[1], sys.argv[2], sys.argv[3]
    judged = mode == "cuda"
    checks, lines = [], []

    def check(name: str, ok: bool, detail: str, target: bool = False) -> None:
        verdict = "PASS" if ok else ("FAIL" if judged or not target else "info")
        checks.append({"check": name, "ok": ok, "detail": detail, "judged": judged or not target})
        lines.append(f"{verdict:4} {name}: {detail}")

    try:
        with open(os.path.join(outdir, "steps.tsv")) as f:
            steps = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    except OSError:
        steps = []
    for name, rc, secs in steps:
        check(f"step {name}", rc == "0", f"exit {rc} after {secs} s")
    pack = _load(outdir, "pack.json")
    for row in (pack or {}).get("rows", []):
        need = PACK_TARGETS.get(row["model"], 0.85)
        for what in ("pack", "unpack"):
            ratio = row[f"{what}_ratio"]
            check(f"{what} {row['model']} x{row['blocks']}", ratio >= need,
                  f"{row[f'{what}_gbps']:.1f} GB/s = {ratio:.2f} x copy {row['copy_gbps']:.1f} GB/s "
                  f"(target {need})", target=True)
    overhead = _load(outdir, "overhead.json")
    if overhead:
        check("pack bitwise (overhead run)", overhead["bitwise"], "torch.equal with the reference")
        check("host us per pack call", overhead["per_layer_us"] <= OVERHEAD_US,
              f"per layer {overhead['per_layer_us']:.1f} us, whole request {overhead['whole_request_us']:.1f} us "
              f"(target {OVERHEAD_US})", target=True)
    transfers = {name: _load(outdir, f"{name}.json") for name in ("transfer", "transfer_cross", "transfer_2gpu")}
    for name, transfer in transfers.items():
        if not transfer:
            continue
        two_gpus = "peer_copy_gbps" in transfer
        yard = f"cudaMemcpyPeer {transfer['peer_copy_gbps']:.1f}" if two_gpus else f"D2D copy {transfer['copy_gbps']:.1f}"
        where = f"{transfer['layout']}{', D on ' + transfer['d_device'] if two_gpus else ''}"
        for ph in transfer["phases"]:
            label = f"transfer {ph['phase']} ({where})"
            check(f"{label} bitwise", ph["bitwise"], f"path {ph['path']}, transport {ph['transport']}")
            peer = ph["phase"] == "cuda_peer"
            if peer:
                check(f"{label} transport", ph["transport"] == "cuda_peer", f"transport {ph['transport']}")
            contig = f", {ph['ratio_to_contig']:.2f} x one contiguous UCX put" if "ratio_to_contig" in ph else ""
            check(f"{label} rate", not peer or ph["ratio_to_copy"] >= TRANSFER_TARGET,
                  f"{ph['gbps']:.1f} GB/s = {ph['ratio_to_copy']:.2f} x {yard} GB/s{contig}, "
                  f"{transfer['bytes'] / 2**20:.0f} MiB, median {ph['median_ms']:.2f} ms"
                  + (f" (target {TRANSFER_TARGET})" if peer else " (no target)"), target=True)
    for name, got in (("pack.json", pack), ("overhead.json", overhead), ("transfer.json", transfers["transfer"]),
                      ("transfer_cross.json", transfers["transfer_cross"])):
        if got is None:
            check(f"result {name}", False, "missing (its step failed)")
    failed = [c for c in checks if not c["ok"] and c["judged"]]
    lines.append(f"== {'PASS' if not failed else 'FAIL'}: {len(failed)} failed of {len(checks)} ({mode} mode)")
    rows = [{k: v for k, v in r.items() if k != "samples_s"} for r in (pack or {}).get("rows", [])]
    with open(os.path.join(dest, "summary.json"), "w") as f:
        json.dump({"mode": mode, "ok": not failed, "checks": checks, "pack": rows,
                   "pack_environment": (pack or {}).get("environment"),
                   "overhead": overhead, **transfers}, f, indent=1, default=str)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
