"""Print the markdown tables of docs/benchmarks.md from the result files in this folder,
so the tables are exactly what the committed files hold. Run from the repository root:

    python benchmarks/make_tables.py
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results"


def _load(name: str):
    path = HERE / name
    return json.loads(path.read_text()) if path.exists() else None


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _load_text(env: dict) -> str:
    start = env.get("load_average_at_start") or env.get("load_average") or [None]
    return _f(start[0])


def _commit(env: dict) -> str:
    return (env.get("git_commit") or "?")[:7] + ("+dirty" if "dirty" in (env.get("git_commit") or "") else "")


def e2e() -> None:
    print("| run | MB | median ms | GB/s | memcpy GB/s (threads) | **x memcpy** | NIXL GB/s | **x NIXL** "
          "| 1-block p50 / p99 µs | verified | load | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("e2e_llama3-8b.json", "e2e_smollm2-135m.json"):
        r = _load(name)
        if r is None:
            continue
        s, env = r["spec"], r["environment"]
        label = f"{name[4:-5]}, {s['blocks'] * s['block_size']} tokens, {r['path']} over {r['transport']}"
        rtt = (f"{r['rtt_p50_us']:.0f} / {r['rtt_p99_us']:.0f}" if r.get("rtt_p50_us") else "-")
        lim = r["memcpy_resources"]
        print(f"| {label} | {r['bytes'] / 1e6:.1f} | {statistics.median(r['seconds']) * 1e3:.1f} | {_f(r['gbps'])} "
              f"| {_f(r['memcpy_gbps'])} ({lim['threads']}) | **{_f(r['ratio_to_memcpy'])}** "
              f"| {_f(r.get('nixl_gbps'))} | **{_f(r.get('ratio_to_nixl'))}** | {rtt} "
              f"| {r['verified_requests']} | {_load_text(env)} | {_commit(env)} |")


def transfer(name: str) -> None:
    doc = _load(name)
    if doc is None:
        return
    env, rows = doc["environment"], doc["rows"]
    nixl = "nixl_gbps" in rows[0]
    tcp = rows[0]["limit"] == "socket"
    head = "| block x batch | transport | GB/s | "
    head += "socket GB/s | **x socket** |" if tcp else "memcpy GB/s (threads) | **x memcpy** |"
    head += " NIXL GB/s | **x NIXL** |" if nixl else ""
    print(f"`{name}` (load {_load_text(env)} at the start, commit {_commit(env)}):\n")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        line = f"| {r['block']} x {r['batch']} | {r['transport']} | {_f(r['gbps'])} | "
        if tcp:
            line += f"{_f(r['socket_gbps'])} | **{_f(r['ratio_to_limit'])}** |"
        else:
            line += f"{_f(r['memcpy_gbps'])} ({r['memcpy_threads']}) | **{_f(r['ratio_to_limit'])}** |"
        if nixl:
            line += f" {_f(r['nixl_gbps'])} | **{_f(r['ratio_vs_nixl'], 1)}** |"
        print(line)
    print()


def perftest() -> None:
    doc = _load("transfer_vs_perftest.json")
    if doc is None:
        return
    env = doc["environment"]
    print(f"`transfer_vs_perftest.json` (load {_load_text(env)} at the start, commit {_commit(env)}):\n")
    print("| round | transport | kvxfer GB/s (median) | kvxfer GB/s (overall) | ucx_perftest GB/s | kvxfer/perftest |")
    print("|---|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['round']} | {r['transport']} | {_f(r['kvxfer_gbps'])} | {_f(r['kvxfer_overall_gbps'])} "
              f"| {_f(r['perftest_gbps'])} | {_f(r['ratio'])} |")
    print(f"\nmedian ratio **{_f(doc['median_ratio'])}**\n")


def pack() -> None:
    doc = _load("pack_cpu.json")
    if doc is None:
        return
    env = doc["environment"]
    print(f"`pack_cpu.json` (load {_load_text(env)} at the start, commit {_commit(env)}):\n")
    print("| model | blocks | MiB | run KiB | pack GB/s | unpack GB/s | copy GB/s | **pack/copy** "
          "| **unpack/copy** | torch pack | torch unpack |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['model']} | {r['blocks']} | {r['mib']:.0f} | {r['run_kib']:.0f} | {_f(r['pack_gbps'])} "
              f"| {_f(r['unpack_gbps'])} | {_f(r['copy_gbps'])} | **{_f(r['pack_ratio'])}** "
              f"| **{_f(r['unpack_ratio'])}** | {_f(r.get('torch_pack_gbps'))} | {_f(r.get('torch_unpack_gbps'))} |")
    print()


if __name__ == "__main__":
    e2e()
    print()
    for name in ("transfer_vm_small.json", "transfer_vm_large.json", "transfer_tcp.json"):
        transfer(name)
    perftest()
    pack()
