"""The virtual clock against the wall-clock simulated engine: 8 workers, same slice, same configs.

    echo -15 > /proc/self/autogroup   # as root, in the shell that starts it (see sim_validate.py)
    nice -n -15 python benchmarks/vclock_validate.py --out benchmarks/results/vclock_validate.json
    nice -n -15 python benchmarks/vclock_validate.py --time-scale 0.2 --also-slo 1000,50 500,20 \
        --port 18610 --out benchmarks/results/vclock_validate_light.json
    nice -n -15 python benchmarks/vclock_validate.py --dilate 8 --port 18640 \
        --out benchmarks/results/vclock_validate_x8.json

For each configuration (``colocated:8``, ``2P6D``, ``conditional:2P6D``, ``adaptive:2P6D``
by default) it starts ``kvxfer serve --engine sim --profile P`` with the flags the
configuration stands for (:mod:`kvxfer.sim.configs`: ``--colocated 8``, ``--prefill 2
--decode 6``, plus ``--local-prefill-tokens``/``--local-prefill-queue`` or ``--adaptive
--adaptive-slo``) and the same engine flags as the virtual clock, replays the trace slice
with ``kvxfer loadgen``, stops it; then runs the virtual clock
(:func:`kvxfer.sim.replay.run_config`) on the same requests: the same slice, jitter
seed, time scale, prompt lengths and ``max_tokens``. Both are scored by
:func:`kvxfer.loadgen.metrics.summarize_run` under the same SLO. It prints goodput and SLO
attainment of both and the vclock/wall ratio, with the load average beside each run.

The slice: the first ``--max-requests`` trace lines from ``--start`` whose scaled prompt +
``max_tokens`` fit 8,192 tokens and a worker's pool (the slice the committed results
used; the simulated engine's own limit is its pool), written to ``<out>/slice.jsonl`` and
replayed by both. Diagnostics besides the ratios: the virtual clock again with each
request arriving when loadgen actually sent it (``vclock_at_sent``), the same runs scored
under ``--also-slo``, and each worker's queue and free blocks sampled during the wall-clock
replay (``--sample-period``). ``--dilate K`` runs the same cluster on a clock K times slower
(profile and link K times slower, arrivals, SLOs and the rebalancer's interval and dwell
K times stretched; the virtual clock's results scale exactly), so the wall-clock stack's own
host time weighs K times less.

Same requests on both sides: loadgen sends text prompts, one common word per
:class:`~kvxfer.loadgen.prompts.PromptBuilder` word, which the router tokenizes; the
virtual clock runs :meth:`PromptBuilder.prompt_ids` (one id per word). The script
tokenizes every prompt of the slice with the router's tokenizer and records how many
differ from the word count (``tokens_vs_words``: none with the default ``--seed 0``; with
``--seed 1`` every prompt of the default slice is one token longer, its first word, without
a leading space, being two tokens); loadgen sends ``ignore_eos`` and the
simulated engine never emits a stop id, so every answer has ``max_tokens`` tokens (each
run records the requests whose ``output_tokens`` differ).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvxfer.loadgen.metrics import SLO, summarize_run  # noqa: E402
from kvxfer.loadgen.prompts import PromptBuilder  # noqa: E402
from kvxfer.loadgen.trace import read_trace  # noqa: E402
from kvxfer.serving.server.adaptive_policy import AdaptivePolicy  # noqa: E402
from kvxfer.sim import configs as sim_configs  # noqa: E402
from sim_validate import cpu_seconds, wait_healthy, worker_pids  # noqa: E402  (benchmarks/)

DEFAULT_CONFIGS = ("colocated:8", "2P6D", "conditional:2P6D", "adaptive:2P6D")
# the rebalancer's default interval and dwell, stretched by --dilate
ADAPTIVE_INTERVAL_S = AdaptivePolicy().interval_s
ADAPTIVE_DWELL_S = AdaptivePolicy().min_dwell_s
_LIVE: list[subprocess.Popen] = []  # servers to kill on exit


def serve_flags(name: str, slo: str, dilate: float = 1.0) -> list[str]:
    """``kvxfer serve`` flags of a virtual-clock configuration name (an adaptive one's
    rebalancer interval and dwell ``dilate`` times the defaults)."""
    sim_configs.parse_config(name)  # ConfigError for a name outside the grammar
    kind, _, rest = name.strip().partition(":")
    kind = kind.lower()
    if kind == "colocated":
        return ["--colocated", rest]
    split = sim_configs._SPLIT.fullmatch(rest or kind)
    flags = ["--prefill", split.group(1), "--decode", split.group(2)]
    if kind == "conditional":
        flags += ["--local-prefill-tokens", str(sim_configs.LOCAL_PREFILL_TOKENS),
                  "--local-prefill-queue", str(sim_configs.LOCAL_PREFILL_QUEUE)]
    elif kind == "adaptive":
        flags += ["--adaptive", "--adaptive-slo", slo]
        if dilate != 1:
            flags += ["--adaptive-interval", f"{ADAPTIVE_INTERVAL_S * dilate:g}",
                      "--adaptive-dwell", f"{ADAPTIVE_DWELL_S * dilate:g}"]
    return flags


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


def _on_signal(signum, frame):
    raise SystemExit(f"signal {signum}")


def _per_worker(url: str) -> dict[str, dict[str, float]]:
    """``{worker: {stat: value}}`` of the workers' counters and gauges on /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("kvxfer_worker_stat{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            name = line.split('stat="', 1)[1].split('"', 1)[0]
            out.setdefault(worker, {})[name] = float(line.rsplit(" ", 1)[1])
    return out


def _worker_stats(url: str) -> dict:
    """Worker counters summed over workers (kv_verified, recv_ok, ...), and per worker."""
    try:
        per = _per_worker(url)
    except OSError as exc:
        return {"error": str(exc)}
    out: dict = {}
    for stats in per.values():
        for name, value in stats.items():
            out[name] = out.get(name, 0.0) + value
    return {"total": out, "per_worker": per}


class _Sampler(threading.Thread):
    """Every ``period`` s: each worker's waiting/running/sending/free_blocks (from /metrics)."""

    KEYS = ("waiting", "running", "sending", "free_blocks", "awaiting_kv")

    def __init__(self, url: str, period: float) -> None:
        super().__init__(daemon=True)
        self.url, self.period, self.samples = url, period, []
        self.stop = threading.Event()

    def run(self) -> None:
        began = time.monotonic()
        while not self.stop.wait(self.period):
            try:
                per = _per_worker(self.url)
            except OSError:
                continue
            self.samples.append({"t": round(time.monotonic() - began, 3),
                                 **{w: {k: v[k] for k in self.KEYS if k in v}
                                    for w, v in per.items()}})


def wall_run(name: str, args, engine: list[str], loadgen: list[str], out_dir: str) -> dict:
    """``kvxfer serve --engine sim`` + ``kvxfer loadgen`` for configuration ``name``."""
    url = f"http://127.0.0.1:{args.port}"
    flags = serve_flags(name, args.slo, args.dilate)
    num_workers = sum(int(x) for x in flags[1:4:2]) if flags[0] != "--colocated" else int(flags[1])
    cmd = [sys.executable, "-m", "kvxfer.cli", "serve", "--port", str(args.port),
           "--log-level", "warning", "--engine", "sim", "--profile", args.profile,
           "--routing", args.routing, *flags, *engine]
    label = "wall-" + name.replace(":", "-")
    if args.step_log:
        cmd += ["--step-log", os.path.join(args.step_log, label)]
    path = os.path.join(out_dir, f"{label}.json")
    # own process group (killpg) in the caller's session (its autogroup priority applies)
    proc = subprocess.Popen(cmd, process_group=0, stdin=subprocess.DEVNULL)
    _LIVE.append(proc)
    try:
        began = time.monotonic()
        wait_healthy(url, proc, args.start_timeout, num_workers)
        started_s = time.monotonic() - began
        pids = {"router": proc.pid, **worker_pids(url)}
        cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        load0 = os.getloadavg()
        sampler = _Sampler(url, args.sample_period) if args.sample_period else None
        if sampler is not None:
            sampler.start()
        began = time.monotonic()
        rc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "loadgen", "--url", url,
                             "--label", label, "--json", path, "--no-progress",
                             "--slo", args.slo, *loadgen],
                            check=False, timeout=args.run_timeout).returncode
        wall = time.monotonic() - began
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = {n: cpu_seconds(p) - cpu0[n] for n, p in pids.items()}
        cpu["loadgen"] = (children1.ru_utime + children1.ru_stime
                          - children0.ru_utime - children0.ru_stime)
        load1 = os.getloadavg()
        if sampler is not None:
            sampler.stop.set()
            sampler.join(timeout=30)
        stats = _worker_stats(url)
    finally:
        _kill(proc)
        _LIVE.remove(proc)
    with open(path) as f:
        records = json.load(f)["requests"]
    lag = sorted(r["sent_s"] - r["scheduled_s"] for r in records)
    short = [r["index"] for r in records if r["ok"] and r["output_tokens"] != r["max_tokens"]]
    return {"label": label, "command": cmd, "loadgen_rc": rc, "startup_s": started_s,
            "replay_s": wall, "cpu_s": cpu, "load_start": load0, "load_end": load1,
            "records": records,
            "send_lag_ms": {"median": 1e3 * lag[len(lag) // 2], "max": 1e3 * lag[-1]},
            "output_tokens_not_max": short, "stats": stats,
            "samples": sampler.samples if sampler is not None else None}


CONTEXT_LENGTH = 8192  # the slice's bound on prompt + max_tokens (the committed results' slice)


def fit_slice(args, path: str) -> dict:
    """Write to ``path`` the first ``--max-requests`` trace lines from ``--start`` whose scaled
    prompt + ``max_tokens`` fit :data:`CONTEXT_LENGTH` and a worker's pool. Both sides
    replay this file; its timestamps are the trace's (rebased by :func:`read_trace`)."""
    from kvxfer.loadgen.trace import parse_line

    prompts = PromptBuilder(length_scale=args.length_scale, output_scale=args.output_scale,
                            seed=args.seed)
    limit = min(CONTEXT_LENGTH, args.num_blocks * 16)
    kept, skipped, last = [], 0, None
    with open(args.trace) as f:
        for lineno, line in enumerate(f):
            if lineno < args.start or not line.strip():
                continue
            req = parse_line(line, lineno + 1)
            if prompts.num_words(req) + prompts.max_tokens(req) > limit:
                skipped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
            last = lineno
            if len(kept) >= args.max_requests:
                break
    with open(path, "w") as f:
        f.writelines(kept)
    return {"path": path, "kept": len(kept), "skipped_too_long": skipped,
            "trace_lines": [args.start, last], "limit_tokens": limit}


def arrivals(args) -> list[tuple[float, list[int], int]]:
    """The slice as loadgen sends it (same jitter, time scale, lengths), read as
    ``kvxfer simulate`` reads a slice; prompts as ids."""
    from kvxfer.sim.replay import TraceSlice

    return TraceSlice(args.slice, max_requests=args.max_requests, time_scale=args.time_scale,
                      length_scale=args.length_scale, output_scale=args.output_scale,
                      jitter_ms=args.arrival_jitter_ms, seed=args.seed).arrivals()


def tokens_vs_words(args) -> dict:
    """The router tokenizer's token count of each loadgen prompt against its word count."""
    from kvxfer.serving.server.text import TextCodec

    codec = TextCodec.load(None)
    reqs = read_trace(args.slice, max_requests=args.max_requests)
    prompts = PromptBuilder(length_scale=args.length_scale, output_scale=args.output_scale,
                            seed=args.seed)
    diffs = [len(codec.encode(prompts.prompt(r))) - prompts.num_words(r) for r in reqs]
    too_long = sum(1 for r in reqs
                   if prompts.num_words(r) + prompts.max_tokens(r) > codec.max_position)
    return {"requests": len(reqs), "differing": sum(1 for d in diffs if d),
            "min_diff": min(diffs), "max_diff": max(diffs),
            "words_total": sum(prompts.num_words(r) for r in reqs),
            "max_tokens_total": sum(prompts.max_tokens(r) for r in reqs),
            "over_context_length": too_long, "context_length": codec.max_position}


def vclock_run(name: str, args, requests, slo: SLO) -> dict:
    from kvxfer.serving.simulated.profile import load_profile
    from kvxfer.sim.replay import RunOptions, run_config

    options = RunOptions(routing=args.routing, num_blocks=args.num_blocks,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         adaptive=AdaptivePolicy(interval_s=ADAPTIVE_INTERVAL_S * args.dilate,
                                                 min_dwell_s=ADAPTIVE_DWELL_S * args.dilate))
    load0 = os.getloadavg()
    began = time.monotonic()
    row = run_config(name, options, load_profile(args.profile), slo, requests)
    return {"label": "vclock-" + name.replace(":", "-"), "run_s": time.monotonic() - began,
            "load_start": load0, "load_end": os.getloadavg(), **row}


def _brief(summary: dict) -> dict:
    keys = ("num_requests", "num_ok", "duration_s", "request_throughput", "goodput",
            "slo_attainment")
    out = {k: summary.get(k) for k in keys}
    for m in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out[m] = {q: summary[m][q] for q in ("median", "p90", "p99")}
    return out


def dilated_profile(name: str, factor: float, path: str) -> str:
    """Write ``name``'s profile ``factor`` times slower (every step-time coefficient and the
    link's latency times ``factor``, its bandwidth divided by it) to ``path``: the same
    cluster on a clock ``factor`` times slower, whose host costs per modelled second are
    ``factor`` times smaller. Returns ``path``."""
    from kvxfer.serving.simulated.profile import load_profile

    raw = load_profile(name).as_dict()
    raw["fit"] = {k: v * factor for k, v in raw["fit"].items()}
    raw["link"]["bandwidth_bytes_per_s"] /= factor
    raw["link"]["latency_s"] *= factor
    raw["name"] = f"{raw['name']}-x{factor:g}"
    raw["points"], raw["residuals"] = [], {}
    with open(path, "w") as f:
        json.dump(raw, f, indent=1)
    return path


def _scaled_slo(text: str, factor: float) -> str:
    ttft, tpot = SLO.parse(text).ttft_ms, SLO.parse(text).tpot_ms
    return f"{ttft * factor:g},{tpot * factor:g}"


def _print_row(name: str, row: dict, ws: dict, v: dict, w: dict) -> None:
    cpu = w["cpu_s"]
    workers = sum(x for k, x in cpu.items() if k not in ("router", "loadgen"))
    print(f"{name}: goodput wall {ws['goodput']:.3f} vclock {v['goodput_rps']:.3f} "
          f"({row['goodput_ratio']:.3f}x); attainment wall {ws['slo_attainment']:.3f} vclock "
          f"{v['slo_attainment']:.3f} ({row['attainment_ratio']:.3f}x); TTFT p50 wall "
          f"{ws['ttft_ms']['median']:.0f} vclock {v['ttft_p50_ms']:.0f} ms, TPOT p50 wall "
          f"{ws['tpot_ms']['median']:.1f} vclock {v['tpot_p50_ms']:.1f} ms; "
          f"{ws['num_ok']}/{ws['num_requests']} ok; load {w['load_start'][0]:.2f}->"
          f"{w['load_end'][0]:.2f}; send lag p50 {w['send_lag_ms']['median']:.0f} ms; CPU s over "
          f"{w['replay_s']:.1f} s: router {cpu['router']:.1f}, loadgen {cpu['loadgen']:.1f}, "
          f"workers {workers:.1f}", flush=True)


def _ratio(a, b):
    return a / b if a is not None and b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    ap.add_argument("--profile", default="h100-llama2-7b-vidur")
    ap.add_argument("--trace", default="benchmarks/traces/mooncake_conversation_trace.jsonl")
    ap.add_argument("--start", type=int, default=1000)
    ap.add_argument("--max-requests", type=int, default=200)
    ap.add_argument("--length-scale", type=float, default=0.3)
    ap.add_argument("--output-scale", type=float, default=0.1)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--arrival-jitter-ms", type=float, default=3000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo", default="2500,150", metavar="TTFT_MS,TPOT_MS")
    ap.add_argument("--also-slo", nargs="*", default=["1000,50", "5000,300"],
                    metavar="TTFT_MS,TPOT_MS",
                    help="score the same runs under these SLOs too")
    ap.add_argument("--routing", choices=("least-loaded", "kv"), default="least-loaded")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to /health")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds for one loadgen")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--sample-period", type=float, default=0.5, metavar="S",
                    help="sample each worker's queue and free blocks every S s (0: off)")
    ap.add_argument("--vclock-only", action="store_true", help="no wall-clock runs")
    ap.add_argument("--step-log", default=None, metavar="DIR",
                    help="the wall-clock workers log their steps to DIR/LABEL/NAME.jsonl")
    ap.add_argument("--out", default="benchmarks/results/vclock_validate.json")
    ap.add_argument("--dilate", type=float, default=1.0, metavar="K",
                    help="run a profile K times slower, the arrivals, SLOs and rebalancer "
                         "periods K times stretched (the same cluster, K times less host time "
                         "per modelled second)")
    args = ap.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    out_dir = os.path.splitext(args.out)[0]
    os.makedirs(out_dir, exist_ok=True)
    if args.dilate != 1:
        args.profile = dilated_profile(args.profile, args.dilate,
                                       os.path.join(out_dir, f"profile-x{args.dilate:g}.json"))
        args.time_scale *= args.dilate
        args.slo = _scaled_slo(args.slo, args.dilate)
        args.also_slo = [_scaled_slo(t, args.dilate) for t in args.also_slo]
    slo = SLO.parse(args.slo)
    engine = ["--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    args.slice = os.path.join(out_dir, "slice.jsonl")
    sliced = fit_slice(args, args.slice)
    loadgen = ["--trace", args.slice, "--max-requests", str(args.max_requests),
               "--length-scale", str(args.length_scale),
               "--output-scale", str(args.output_scale), "--time-scale", str(args.time_scale),
               "--arrival-jitter-ms", str(args.arrival_jitter_ms), "--seed", str(args.seed),
               "--request-timeout", str(args.request_timeout)]
    requests = arrivals(args)
    check = tokens_vs_words(args)
    print(f"{len(requests)} requests over {requests[-1][0]:.1f} s (trace lines "
          f"{sliced['trace_lines']}, {sliced['skipped_too_long']} over {sliced['limit_tokens']} "
          f"tokens left out); prompts: {check['differing']} "
          f"of {check['requests']} tokenize to other than their word count "
          f"(diff {check['min_diff']}..{check['max_diff']}); {check['over_context_length']} over "
          f"the context length", flush=True)
    rows = []
    try:
        for name in args.configs:
            v = vclock_run(name, args, requests, slo)
            row = {"config": name, "vclock": {k: v[k] for k in v if k != "records"}}
            row["vclock"]["summary"] = _brief(summarize_run(v["records"], slo))
            vg, va = v["goodput_rps"], v["slo_attainment"]
            if not args.vclock_only:
                w = wall_run(name, args, engine, loadgen, out_dir)
                ws = summarize_run(w["records"], slo)
                row["wall"] = {k: w[k] for k in w if k != "records"} | {"summary": _brief(ws)}
                wg, wa = ws["goodput"], ws["slo_attainment"]
                # diagnostic: the virtual clock with each request arriving when loadgen sent it
                at_sent = [(rec["sent_s"], *requests[rec["index"]][1:]) for rec in w["records"]]
                v2 = vclock_run(name, args, sorted(at_sent, key=lambda x: x[0]), slo)
                row["vclock_at_sent"] = {"goodput_rps": v2["goodput_rps"],
                                         "slo_attainment": v2["slo_attainment"],
                                         "goodput_ratio": _ratio(v2["goodput_rps"], wg),
                                         "attainment_ratio": _ratio(v2["slo_attainment"], wa)}
                row["goodput_ratio"], row["attainment_ratio"] = _ratio(vg, wg), _ratio(va, wa)
                row["also"] = {}
                for text in args.also_slo:
                    other = SLO.parse(text)
                    a, b = summarize_run(w["records"], other), summarize_run(v["records"], other)
                    row["also"][text] = {
                        "wall_goodput": a["goodput"], "vclock_goodput": b["goodput"],
                        "goodput_ratio": _ratio(b["goodput"], a["goodput"]),
                        "wall_attainment": a["slo_attainment"],
                        "vclock_attainment": b["slo_attainment"],
                        "attainment_ratio": _ratio(b["slo_attainment"], a["slo_attainment"])}
                    print(f"  {name} at SLO {text}: goodput wall {a['goodput']:.3f} vclock "
                          f"{b['goodput']:.3f}; attainment wall {a['slo_attainment']:.3f} vclock "
                          f"{b['slo_attainment']:.3f}", flush=True)
                _print_row(name, row, ws, v, w)
            else:
                print(f"{name}: vclock goodput {vg:.3f} attainment {va:.3f} TTFT p50 "
                      f"{v['ttft_p50_ms']:.0f} p99 {v['ttft_p99_ms']:.0f} TPOT p50 "
                      f"{v['tpot_p50_ms']:.1f} p99 {v['tpot_p99_ms']:.1f}", flush=True)
            rows.append(row)
    finally:
        for proc in list(_LIVE):
            _kill(proc)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "slice": sliced, "tokens_vs_words": check,
                       "configs": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
