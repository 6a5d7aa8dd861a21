"""``kvxfer plan``: the best configuration of N accelerators for a trace and an SLO.

    kvxfer plan --trace T.jsonl --profile h100-llama2-7b-vidur --slo 2500,150 --gpus 16 \\
        --max-requests 1000 --num-blocks 6000 --json plan.json --plot plots/

The configurations of ``--gpus`` workers (:func:`kvxfer.sim.configs.configs_for`:
colocated, each xPyD split, conditional and adaptive variants) run on the virtual
clock at the trace's rate (``--time-scale``), ``--jobs`` at a time, and the table is
printed with the best by goodput (``kvxfer loadgen``'s: requests per second meeting
both SLOs). By default the search is pruned (:func:`search`): colocated, a coarse grid
of splits refined around the best one, then the conditional and adaptive variants of
the ``--variants`` best splits; ``--exhaustive`` runs every configuration.
``--rates`` (default with ``--plot``: 0.5,1,1.5,2,3) adds, for the best ``--top``, a
sweep of the request rate (time-scale divided by each factor), giving each one's
DistServe-style capacity: the highest rate at which at least ``--attainment`` of
requests meet the SLO; ``--plot DIR`` draws goodput and SLO attainment against the rate.
"""
from __future__ import annotations

import time

from ..sim.configs import split_of
from .simulate import add_common, best_of, load_inputs, print_rows, run_config, write_json


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="sweep the configurations of N accelerators on the virtual clock",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--slo", required=True, metavar="TTFT_MS,TPOT_MS", help="SLO for goodput")
    p.add_argument("--gpus", type=int, required=True, help="accelerators (workers) to split")
    p.add_argument("--exhaustive", action="store_true",
                   help="run every configuration, not the pruned search")
    p.add_argument("--variants", type=int, default=2, metavar="K",
                   help="pruned search: the K best splits get conditional/adaptive variants")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="configurations run at once, one process each (default: the CPUs)")
    p.add_argument("--rates", default=None, metavar="X,...",
                   help="rate factors swept for the top configurations (default: none; "
                        "0.5,1,1.5,2,3 with --plot)")
    p.add_argument("--top", type=int, default=2, help="configurations given the rate sweep")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="SLO attainment a rate must reach to count as served (DistServe: 0.9)")
    p.add_argument("--plot", metavar="DIR", help="write goodput/attainment-vs-rate PNGs here")
    p.set_defaults(func=run)


def _factors(text: str) -> list[float]:
    try:
        out = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--rates wants comma-separated numbers > 0, got {text!r}") from None
    if any(not f > 0 for f in out):
        raise ValueError(f"--rates wants numbers > 0, got {text!r}")
    return out


def capacity(points: list[dict], target: float) -> float:
    """The highest offered rate whose attainment reaches ``target`` (0.0 if none does);
    ``points`` are ``{"rate_rps", "slo_attainment"}``."""
    ok = [p["rate_rps"] for p in points if p["slo_attainment"] >= target]
    return max(ok) if ok else 0.0


def split_grid(num_gpus: int, points: int = 3) -> list[int]:
    """Prefill counts ``x`` of the first round of splits: ``points`` inside 1..N-1, at
    ``N * k / (points + 1)``, or every split where there are no more. The ends are left to
    the refinement: it reaches them when the goodput rises towards one."""
    top = num_gpus - 1
    if top <= points:
        return list(range(1, top + 1))
    return sorted({min(max(round(num_gpus * k / (points + 1)), 1), top) for k in range(1, points + 1)})


def search(num_gpus: int, evaluate, *, variants: int = 2) -> list[dict]:
    """The pruned search over the configurations of ``num_gpus`` workers.

    ``evaluate(names) -> rows`` runs configurations (``run_config``'s rows, with
    ``goodput_rps``). Rounds: ``colocated:N`` and the :func:`split_grid` splits; then,
    while the gap between tried prefill counts around the best split is > 1, the
    midpoints on each side of it (goodput is unimodal in the split in practice: too
    few prefill workers queue prompts, too few decode workers slow tokens); then the
    conditional and (from 3 workers) adaptive variants of the ``variants`` best splits.
    Returns every row run."""
    rows = {r["name"]: r for r in evaluate([f"colocated:{num_gpus}"]
                                           + [f"{x}P{num_gpus - x}D" for x in split_grid(num_gpus)])}

    def tried() -> dict[int, dict]:
        return {int(n.split("P")[0]): r for n, r in rows.items() if n[0].isdigit()}

    while True:
        splits = tried()
        xs = sorted(splits)
        best = max(xs, key=lambda x: splits[x]["goodput_rps"])
        i = xs.index(best)
        new = []
        for lo, hi in ((xs[i - 1] if i else 0, best), (best, xs[i + 1] if i + 1 < len(xs) else num_gpus)):
            mid = (lo + hi) // 2
            if 1 <= mid <= num_gpus - 1 and mid not in splits:
                new.append(mid)
        if not new:
            break
        rows.update((r["name"], r) for r in evaluate([f"{x}P{num_gpus - x}D" for x in new]))
    splits = tried()
    ranked = sorted(splits, key=lambda x: -splits[x]["goodput_rps"])[:max(variants, 0)]
    kinds = ("conditional", "adaptive") if num_gpus >= 3 else ("conditional",)
    names = [f"{kind}:{x}P{num_gpus - x}D" for x in ranked for kind in kinds]
    rows.update((r["name"], r) for r in evaluate(names))
    return list(rows.values())


# the trace slice (and its prompts' block hashes) and options of a plan, inherited by
# its --jobs processes (fork)
_SHARED: dict = {}


def _run_one(job: tuple[str, float | None, bool]) -> dict:
    name, time_scale, twin = job
    from .simulate import arrivals

    args, profile, slo = _SHARED["args"], _SHARED["profile"], _SHARED["slo"]
    if time_scale is None:
        requests, hashes = _SHARED["requests"], _SHARED["hashes"]
    else:
        requests, hashes = arrivals(args, time_scale), None
    # plan ranks by goodput: least-loaded's runs skip counting the router's hits
    row = run_config(name, args, profile, slo, requests, hashes, twin=twin, routed_hits=False)
    row.pop("records")
    if row.get("twin"):
        row["twin"].pop("records")
    return row


def has_twin(name: str) -> bool:
    """Whether ``name`` is a static split with an ``adaptive:`` variant (>= 3 workers)."""
    split = split_of(name)
    return split is not None and sum(split) >= 3


class _Runner:
    """``evaluate(jobs)``: rows of ``(config, time_scale or None)`` jobs, ``jobs`` processes
    at a time (forked: they inherit the trace slice); in this process when ``jobs`` is 1.

    A static split's run also watches its adaptive variant's rebalancer (``run_config``'s
    ``twin``): where that never moved a worker, ``adaptive:xPyD``'s row is the split's own
    run and is not run again. ``runs`` counts the virtual-clock runs made."""

    def __init__(self, jobs: int) -> None:
        self.jobs, self.pool, self.runs = jobs, None, 0
        self.twins: dict[str, dict | None] = {}  # split -> its adaptive row (None: it moved)

    def __call__(self, jobs: list) -> list[dict]:
        jobs = [j if isinstance(j, tuple) else (j, None) for j in jobs]
        done: dict[tuple, dict] = {}
        first, later = [], []
        for job in jobs:
            name, time_scale = job
            split = name.partition(":")[2] if name.startswith("adaptive:") else None
            if split is None or time_scale is not None:
                first.append(job)
            elif self.twins.get(split) is not None:
                done[job] = self.twins[split]
            elif split not in self.twins and (split, None) in jobs:
                later.append(job)  # its split runs in this batch: it may answer for it
            else:
                first.append(job)
        self._run(first, done)
        self._run([j for j in later if self.twins.get(j[0].partition(":")[2]) is None], done)
        for job in later:
            done.setdefault(job, self.twins[job[0].partition(":")[2]])
        return [done[job] for job in jobs]

    def _run(self, jobs: list, done: dict) -> None:
        if not jobs:
            return
        tasks = [(name, time_scale, time_scale is None and has_twin(name))
                 for name, time_scale in jobs]
        self.runs += len(tasks)
        if self.jobs <= 1 or len(tasks) <= 1:
            rows = [_run_one(t) for t in tasks]
        else:
            if self.pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                self.pool = ProcessPoolExecutor(self.jobs,
                                                mp_context=multiprocessing.get_context("fork"))
            rows = list(self.pool.map(_run_one, tasks))
        for (name, time_scale, twin), row in zip(tasks, rows):
            if twin:
                self.twins[name] = row.pop("twin")
            done[(name, time_scale)] = row

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def run(args) -> int:
    import os

    from ..sim.configs import configs_for
    from ..sim.vclock import prompt_hashes

    began = time.perf_counter()
    try:
        names = configs_for(args.gpus)
        factors = _factors(args.rates if args.rates is not None
                           else "0.5,1,1.5,2,3" if args.plot else "")
        if not 0 < args.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
        jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
    except ValueError as exc:
        raise SystemExit(f"kvxfer plan: {exc}") from None
    profile, slo, requests = load_inputs(args)
    span = requests[-1][0] - requests[0][0]
    base_rate = len(requests) / span if span > 0 else float("inf")
    _SHARED.update(args=args, profile=profile, slo=slo, requests=requests,
                   hashes=prompt_hashes(requests, profile.block_size))
    runner = _Runner(jobs)
    try:
        rows = runner(names) if args.exhaustive else search(args.gpus, runner, variants=args.variants)
        best = best_of(rows)
        print_rows(f"plan: {args.gpus} accelerators, {len(requests)} requests at "
                   f"{base_rate:.2f} req/s, profile {profile.name}, SLO {args.slo}"
                   f"{'' if args.exhaustive else f', pruned search ({len(rows)} of {len(names)})'}",
                   rows, best)
        curves = {}
        if factors and span > 0:
            top = sorted(rows, key=lambda r: -r["goodput_rps"])[:max(args.top, 1)]
            swept = runner([(row["name"], args.time_scale / f) for row in top for f in factors])
            for k, row in enumerate(top):
                points = [{"rate_factor": f, "rate_rps": base_rate * f,
                           "goodput_rps": out["goodput_rps"], "slo_attainment": out["slo_attainment"]}
                          for f, out in zip(factors, swept[k * len(factors):(k + 1) * len(factors)])]
                row["rate_sweep"] = points
                row["capacity_rps"] = capacity(points, args.attainment)
                curves[row["name"]] = points
                print(f"{row['name']}: capacity {row['capacity_rps']:.2f} req/s at >= "
                      f"{100 * args.attainment:g}% SLO attainment; "
                      + ", ".join(f"x{p['rate_factor']:g} {100 * p['slo_attainment']:.0f}%" for p in points))
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvxfer plan: {exc}") from None
    finally:
        runner.close()
        _SHARED.clear()
    elapsed = time.perf_counter() - began
    print(f"best: {best}; plan took {elapsed:.1f} s ({runner.runs} virtual-clock runs, "
          f"{jobs} at a time)")
    if args.json:
        write_json(args.json, best, rows, {"profile": profile.name, "gpus": args.gpus,
                                           "slo": args.slo, "routing": args.routing,
                                           "store": args.store,
                                           "num_requests": len(requests), "exhaustive": args.exhaustive,
                                           "runs": runner.runs, "jobs": jobs,
                                           "base_rate_rps": base_rate, "elapsed_s": elapsed})
    if args.plot and curves:
        _plot(args.plot, curves, args.attainment)
    return 0


def _plot(folder: str, curves: dict[str, list[dict]], target: float) -> None:
    import os

    try:
        import matplotlib
    except ImportError:
        raise SystemExit("kvxfer plan: --plot needs matplotlib (pip install 'kvxfer[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    for key, label, fname in (("goodput_rps", "goodput (req/s)", "goodput_vs_rate.png"),
                              ("slo_attainment", "SLO attainment", "attainment_vs_rate.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, points in curves.items():
            ax.plot([p["rate_rps"] for p in points], [p[key] for p in points], marker="o",
                    label=name)
        if key == "slo_attainment":
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(folder, fname), dpi=120)
        plt.close(fig)
