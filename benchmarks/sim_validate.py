"""The simulated engine against the real one: same trace slice, same configurations.

    python benchmarks/sim_validate.py --profile cpu-smollm2 --out benchmarks/results/sim_validate.json

For each configuration (1P1D on one core each, 2 colocated on one core each,
2P1D sharing both cores) it starts ``kvxfer serve`` with the real embedded
engine, replays the trace slice with ``kvxfer loadgen``, stops it, then does
the same with ``--engine sim --profile P`` and the same flags (2P1D's simulated
workers share two modelled devices, as its real workers share two cores:
``--sim-devices 2``). It prints TTFT and TPOT p50/p90 of both and the sim/real
ratio, with the load average beside each run; with ``--slo`` each run's goodput
and each engine's best configuration, with ``--vclock`` also ``kvxfer simulate``
of each configuration and profile. ``--engines real --step-log DIR`` runs only the
real engine and keeps its workers' step logs, to fit a profile from (``kvxfer
profile --from-steps``) on another slice than the one validated. Run it at high
priority; where the kernel groups processes by session
(``/proc/sys/kernel/sched_autogroup_enabled`` = 1), ``nice`` alone does not
outrank other sessions' jobs: also ``echo -15 > /proc/self/autogroup`` in the
shell that starts it (the servers stay in its session). ``--scale`` instead runs
only the simulated engine with many workers (e.g. ``--scale 16,16``) and reports the router's and workers' CPU use and how far
the load generator fell behind its schedule; with ``--vclock`` it also runs ``kvxfer
simulate`` on the same slice, profile, configuration and engine flags and gives the
wall/virtual-clock TTFT and TPOT ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from kvxfer.loadgen.metrics import SLO, summarize_run

CONFIGS = {"1P1D": ["--prefill", "1", "--decode", "1", "--cpus", "0", "1", "--threads", "1"],
           "2colocated": ["--colocated", "2", "--cpus", "0", "1", "--threads", "1"],
           "2P1D": ["--prefill", "2", "--decode", "1", "--cpus", "0-1", "--threads", "1"]}
# the simulated engine's flags per configuration: 2P1D's three workers share two cores, so
# its simulated workers share two modelled devices (docs/simulate.md, "Shared devices")
SIM_FLAGS = {"1P1D": [], "2colocated": [], "2P1D": ["--sim-devices", "2"]}
VCLOCK_NAMES = {"1P1D": "1P1D", "2colocated": "colocated:2", "2P1D": "2P1D"}  # kvxfer simulate's


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300, num_workers: int = 0) -> None:
    """Until ``url``'s /health says ok with at least ``num_workers`` workers; RuntimeError if
    the server exits, TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvxfer serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                doc = json.load(r)
            if doc.get("status") == "ok" and len(doc.get("workers", ())) >= num_workers:
                return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not healthy within {timeout:.0f} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (from /proc; clock ticks); NaN once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_pids(url: str) -> dict[str, int]:
    """``{worker name: pid}`` from ``url``'s /health (workers without a pid left out)."""
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return {w["name"]: w["pid"] for w in json.load(r)["workers"] if w.get("pid")}


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def run_one(serve_args: list[str], loadgen_args: list[str], port: int, label: str,
            out_dir: str, slo=None) -> dict:
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvxfer.cli", "serve", "--port", str(port),
           "--log-level", "warning", *serve_args]
    # own process group (for killpg) but not a new session: a new session would also
    # get a new scheduler autogroup, where the caller's nice value does not apply
    proc = subprocess.Popen(cmd, process_group=0, stdin=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        pids = worker_pids(url)
        cpu0 = {"router": cpu_seconds(proc.pid), **{n: cpu_seconds(p) for n, p in pids.items()}}
        load0 = os.getloadavg()[0]
        path = os.path.join(out_dir, f"{label}.json")
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "kvxfer.cli", "loadgen", "--url", url,
                        "--label", label, "--json", path, "--no-progress", *loadgen_args],
                       check=False, timeout=1800)
        wall = time.monotonic() - began
        cpu = {"router": cpu_seconds(proc.pid) - cpu0["router"],
               **{n: cpu_seconds(p) - cpu0[n] for n, p in pids.items()}}
        metrics = _metrics(url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(path) as f:
        doc = json.load(f)
    summary = doc["summary"] if slo is None else summarize_run(doc["requests"], slo)
    return {"label": label, "summary": summary, "schedule": schedule_lag(path), "wall_s": wall, "cpu_s": cpu,
            "load_start": load0, "load_end": os.getloadavg()[0], "stats": _stats(metrics)}


def schedule_lag(path: str) -> dict:
    """How far ``kvxfer loadgen`` fell behind its schedule (sent minus due, ms) and when it
    sent its first and last request, from its per-request ``--json`` file."""
    with open(path) as f:
        recs = [r for r in json.load(f)["requests"] if r.get("sent_s") is not None]
    lag = sorted(1e3 * (r["sent_s"] - r["scheduled_s"]) for r in recs)
    at = lambda q: lag[min(len(lag) - 1, int(q * len(lag)))]  # noqa: E731
    return {"lag_ms_p50": at(0.5), "lag_ms_p90": at(0.9), "lag_ms_p99": at(0.99),
            "lag_ms_max": lag[-1], "first_sent_s": min(r["sent_s"] for r in recs),
            "last_sent_s": max(r["sent_s"] for r in recs),
            "last_due_s": max(r["scheduled_s"] for r in recs)}


_SLICE = {"--start", "--max-requests", "--time-scale", "--length-scale", "--output-scale",
          "--arrival-jitter-ms", "--seed"}
_ENGINE = {"--num-blocks", "--max-num-seqs", "--max-num-batched-tokens", "--routing",
           "--routing-load-gap", "--routing-overlap-weight", "--sim-devices"}


def _pick(args: list[str], names: set[str]) -> list[str]:
    """The ``--flag value`` pairs of ``args`` whose flag is in ``names``."""
    return [x for i in range(0, len(args) - 1) if args[i] in names for x in args[i:i + 2]]


def vclock(trace: str, profile: str, config: str, loadgen_args: list[str],
           serve_args: list[str], out_dir: str, slo=None, label: str | None = None) -> dict:
    """``kvxfer simulate`` of the same slice, profile, config and engine flags: its
    summary (``kvxfer loadgen``'s, from its records; goodput and attainment with ``slo``)."""
    path = os.path.join(out_dir, f"{label}.json" if label else f"vclock-{config}.json")
    subprocess.run([sys.executable, "-m", "kvxfer.cli", "simulate", "--trace", trace,
                    "--profile", profile, "--config", config, "--json", path,
                    *_pick(loadgen_args, _SLICE), *_pick(serve_args, _ENGINE)],
                   check=True, stdout=subprocess.DEVNULL, timeout=3600)
    with open(path) as f:
        doc = json.load(f)["configs"][0]
    return {"config": config, "summary": summarize_run(doc["records"], slo),
            "virtual_s": doc.get("virtual_s")}


def _line(label: str, s: dict, slo) -> str:
    """One run's TTFT/TPOT p50/p90 (and goodput with ``slo``) for the printed table."""
    line = (f"{label}: TTFT p50 {s['ttft_ms']['median']:.0f} p90 {s['ttft_ms']['p90']:.0f}; "
            f"TPOT p50 {s['tpot_ms']['median']:.0f} p90 {s['tpot_ms']['p90']:.0f}")
    if slo is not None:
        line += f"; goodput {s['goodput']:.3f} req/s, SLO met {100 * s['slo_attainment']:.0f}%"
    return line


def _ratios(wall: dict, vc: dict) -> dict:
    return {f"{m}_{q}": wall[m][q] / vc[m][q] for m in ("ttft_ms", "tpot_ms")
            for q in ("median", "p90")}


def _stats(metrics: str) -> dict:
    """Worker counters summed over workers (kv_verified, recv_ok, ...)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("kvxfer_worker_stat{"):
            name = line.split('stat="', 1)[1].split('"', 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", nargs="+", default=["cpu-smollm2"],
                    help="cost profile(s): each configuration runs the simulated engine once "
                         "per profile, after the real engine (--scale: the first)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--trace", default="benchmarks/traces/mooncake_conversation_trace.jsonl")
    ap.add_argument("--loadgen", default="--start 300 --max-requests 24 --length-scale 0.03 "
                                         "--output-scale 0.04 --arrival-jitter-ms 3000 --time-scale 2 "
                                         "--seed 1",
                    help="kvxfer loadgen flags of the slice (besides --trace)")
    ap.add_argument("--serve", default="--num-blocks 1024", help="extra kvxfer serve flags")
    ap.add_argument("--scale", default=None, metavar="P,D",
                    help="only the simulated engine, P prefill and D decode workers")
    ap.add_argument("--vclock", action="store_true",
                    help="also kvxfer simulate the same slice and config with each profile "
                         "(--scale: and give the wall/vclock TTFT and TPOT ratios)")
    ap.add_argument("--slo", default=None, metavar="TTFT_MS,TPOT_MS",
                    help="score every run's goodput and SLO attainment, and name each "
                         "engine's best configuration")
    ap.add_argument("--engines", nargs="+", default=["real", "sim"], choices=("real", "sim"),
                    help="which engines to run per configuration (real alone: runs to fit a "
                         "profile from, with --step-log)")
    ap.add_argument("--step-log", default=None, metavar="DIR",
                    help="workers log their steps to DIR/LABEL/NAME.jsonl (kvxfer profile "
                         "--from-steps fits them)")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--out", default="benchmarks/results/sim_validate.json")
    args = ap.parse_args()

    slo = SLO.parse(args.slo) if args.slo else None
    out_dir = os.path.splitext(args.out)[0]
    os.makedirs(out_dir, exist_ok=True)
    loadgen = ["--trace", args.trace, *args.loadgen.split()]
    sim = ["--engine", "sim", "--profile", args.profile[0]]
    runs = []
    if args.scale:
        p, d = args.scale.split(",")
        run = run_one(["--prefill", p, "--decode", d, *args.serve.split(), *sim], loadgen,
                      args.port, f"sim-{p}P{d}D", out_dir)
        runs.append(run)
        cpu = run["cpu_s"]
        workers = [v for k, v in cpu.items() if k != "router"]
        s = run["summary"]
        print(f"{p}P{d}D sim: {s['num_ok']}/{s['num_requests']} ok in {run['wall_s']:.0f} s; "
              f"router CPU {cpu['router']:.1f} s ({100 * cpu['router'] / run['wall_s']:.0f}% of a "
              f"core); workers {sum(workers):.1f} s total ({100 * sum(workers) / run['wall_s']:.0f}% "
              f"of a core, max one {max(workers):.1f} s); stats {run['stats']}; load "
              f"{run['load_start']:.2f}->{run['load_end']:.2f}; schedule {run['schedule']}")
        if args.vclock:
            run["vclock"] = vclock(args.trace, args.profile[0], f"{p}P{d}D", args.loadgen.split(),
                                   args.serve.split(), out_dir)
            run["wall_over_vclock"] = _ratios(s, run["vclock"]["summary"])
            print(f"wall / vclock: {run['wall_over_vclock']}")
    else:
        for name in args.configs:
            engines = [("real", "real", [])] if "real" in args.engines else []
            if "sim" in args.engines:
                engines += [(f"sim-{os.path.splitext(os.path.basename(p))[0]}"
                             if len(args.profile) > 1 else "sim", "sim",
                             ["--engine", "sim", "--profile", p, *SIM_FLAGS[name]])
                            for p in args.profile]
            real = None
            for label, engine, extra in engines:
                if args.step_log:
                    extra = [*extra, "--step-log", os.path.join(args.step_log, f"{label}-{name}")]
                run = run_one([*CONFIGS[name], *args.serve.split(), *extra], loadgen, args.port,
                              f"{label}-{name}", out_dir, slo)
                run.update(config=name, engine=engine)
                runs.append(run)
                s = run["summary"]
                row = [f"{_line(f'{label}-{name}', s, slo)}; load {run['load_start']:.2f}"]
                if engine == "real":
                    real = s
                else:
                    run["sim_over_real"] = None if real is None else {
                        f"{m}_{q}": s[m][q] / real[m][q] for m in ("ttft_ms", "tpot_ms")
                        for q in ("median", "p90")}
                    if real is not None:
                        row.append("sim/real " + ", ".join(
                            f"{k} {v:.2f}x" for k, v in run["sim_over_real"].items()))
                print("; ".join(row), flush=True)
            if args.vclock and "sim" in args.engines:
                for prof in args.profile:
                    label = f"vclock-{os.path.splitext(os.path.basename(prof))[0]}"
                    vc = vclock(args.trace, prof, VCLOCK_NAMES[name], args.loadgen.split(),
                                [*args.serve.split(), *SIM_FLAGS[name]], out_dir, slo,
                                f"{label}-{name}")
                    vc.update(label=f"{label}-{name}", config=name, engine="vclock")
                    runs.append(vc)
                    print(_line(f"{label}-{name}", vc["summary"], slo), flush=True)
        if slo is not None:
            best = {}
            for run in runs:
                key = run["label"].rsplit("-", 1)[0] if run.get("engine") != "real" else "real"
                g = run["summary"]["goodput"]
                if key not in best or g > best[key][1]:
                    best[key] = (run["config"], g)
            print("best by goodput: " + "; ".join(f"{k} {c} ({g:.3f} req/s)"
                                                  for k, (c, g) in best.items()))
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
