"""``kvxfer plan``'s search: the configuration and tensor-parallel degrees that serve the
highest request rate per GPU within an SLO, as DistServe's placement search does.

A configuration's **capacity** is the highest request rate at which at least
``target`` of the requests meet the SLO (:data:`MODES`: ``"both"`` SLOs met by the
same request, DistServe's paper metric; or ``"each"``: TTFT met by ``target`` of the
requests and TPOT met by ``target``, as DistServe's simulator counts). The rate is
offered by scaling the slice's arrivals; rates lie on a grid of per-GPU rates
``STEP ** k`` (:func:`grid_rate`), 5% apart, and a capacity is found by bisection on
it (:func:`capacity_probes`), assuming attainment falls as the rate rises. A run that
can no longer reach the target stops early (:class:`SLOWatch`).

:class:`Planner` ranks configurations by capacity per GPU (ties: fewer GPUs, then the
order of :func:`kvxfer.sim.configs.placements`). Its pruned search is a branch and
bound: configurations in order of an optimistic estimate (:func:`estimate`), each
first run once at the rate per GPU it would need to beat the best so far; only one that
passes is searched further. With attainment falling in the rate, that is the
exhaustive search's pick (each configuration searched in full), at a fraction of the runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .configs import canonical, gpus_of, layout_of, placements
from .replay import RunOptions, run_config

MODES = ("both", "each")
STEP = 1.05  # the rate grid's ratio: a capacity is found to within 5%
K_MIN = -100  # 1.05 ** -100 = 0.0076 req/s a GPU: below it, a configuration serves nothing


def grid_rate(k: int) -> float:
    """Per-GPU rate (req/s) of grid point ``k``."""
    return STEP ** k


def grid_index(per_gpu_rate: float) -> int:
    """The highest grid point at or below ``per_gpu_rate``."""
    k = math.floor(math.log(per_gpu_rate) / math.log(STEP))
    return k + 1 if grid_rate(k + 1) <= per_gpu_rate else k


class SLOWatch:
    """Counts a run's SLO misses as requests get their first token and end
    (:func:`kvxfer.sim.vclock.simulate`'s ``watch``); True once ``target`` of
    ``num_requests`` can no longer be met. A rejected request misses both."""

    def __init__(self, slo, mode: str, target: float, num_requests: int) -> None:
        self.ttft_s, self.tpot_s = slo.ttft_ms, slo.tpot_ms  # compared as SLO.met does
        self.mode = mode
        # at most this many misses (of each SLO, or of either) still reach the target
        self.allowed = num_requests - math.ceil(target * num_requests - 1e-9)
        self.ttft_misses = self.tpot_misses = self.both_misses = 0
        self._missed: set = set()

    def __call__(self, r, done: bool) -> bool:
        times = r.token_times
        if not times:  # refused: longer than a pool
            self.ttft_misses += 1
            self.tpot_misses += 1
            self.both_misses += 1
        elif not done:
            if (times[0] - r.arrival_s) * 1e3 > self.ttft_s:
                self.ttft_misses += 1
                self.both_misses += 1
                self._missed.add(r.rid)
        elif len(times) > 1 and (times[-1] - times[0]) / (len(times) - 1) * 1e3 > self.tpot_s:
            self.tpot_misses += 1
            if r.rid not in self._missed:
                self.both_misses += 1
        if self.mode == "both":
            return self.both_misses > self.allowed
        return self.ttft_misses > self.allowed or self.tpot_misses > self.allowed


def attainment(records: list[dict], slo, mode: str) -> float:
    """The attainment :data:`MODES` ``mode`` counts: ``both``, the share of requests
    meeting both SLOs; ``each``, the lower of the shares meeting each."""
    if not records:
        return float("nan")
    ok = [r for r in records if r.get("ok")]
    ttft = sum(1 for r in ok if r["ttft_s"] * 1e3 <= slo.ttft_ms)
    tpot = sum(1 for r in ok if r["tpot_s"] is None or r["tpot_s"] * 1e3 <= slo.tpot_ms)
    if mode == "each":
        return min(ttft, tpot) / len(records)
    return sum(1 for r in records if slo.met(r)) / len(records)


def capacity_probes(guess: int, *, passes_at: int | None = None, threshold: int | None = None):
    """A generator of grid points to probe (send it True/False for each), returning the
    highest passing point (None: none above ``K_MIN``, or none at ``threshold``).

    ``threshold``: probe it first and stop at a failure there (the branch and bound's
    test); ``passes_at``: a point known to pass. Otherwise it starts at ``guess``, steps
    by doubling strides to a bracket, then bisects it."""
    lo = passes_at  # highest known pass
    hi = None  # lowest known fail
    if threshold is not None and lo is None:
        if not (yield threshold):
            return None
        lo = threshold
    if lo is None:
        if (yield guess):
            lo = guess
        else:
            hi, stride = guess, 1
            while True:
                if hi <= K_MIN:
                    return None
                k = max(hi - stride, K_MIN)
                if (yield k):
                    lo = k
                    break
                hi, stride = k, stride * 2
    if hi is None:
        stride = 1
        while True:
            k = lo + stride
            if (yield k):
                lo, stride = k, stride * 2
            else:
                hi = k
                break
    while hi - lo > 1:
        k = (lo + hi) // 2
        if (yield k):
            lo = k
        else:
            hi = k
    return lo


def estimate(name: str, profile, requests, slo, target: float, mode: str) -> float:
    """An optimistic guess of configuration ``name``'s capacity per GPU (req/s), to order
    the pruned search and seed each bisection (nothing relies on it being right): the
    rate at which its busier pool is fully busy, each request's prefill and decode work at
    the best batching the fit allows (per-step constants left out), scaled down by how
    little room the SLO leaves even alone: the share of requests whose prefill alone
    meets the TTFT and whose decode steps alone meet the TPOT, over ``target``."""
    lay = layout_of(name)
    ttft_s, tpot_s = slo.ttft_ms / 1e3, slo.tpot_ms / 1e3

    def work(tp: int) -> tuple[float, float, list[bool], list[bool]]:
        fit = profile.at_tp(tp).fit
        alone = [fit.step_seconds([(max(2, len(ids)), 0)]) for _, ids, _ in requests]
        k = fit.coefficients if fit.large_batch is None else (0, 0, 0, *fit.large_batch)
        dec = sum(max(mt - 1, 0) * (k[4] + k[5] * (len(ids) + mt / 2)) for _, ids, mt in requests)
        tpot = [fit.step_seconds([(1, len(ids) + mt // 2)]) <= tpot_s for _, ids, mt in requests]
        pre = (sum(alone) - fit.coefficients[0] * len(alone)) / len(requests)
        return pre, dec / len(requests), [t <= ttft_s for t in alone], tpot

    pre, _, ttft_ok, _ = work(lay.prefill_tp)
    _, dec, _, tpot_ok = work(lay.decode_tp)
    if lay.kind == "colocated":
        rate = lay.num_prefill / (pre + dec)
    else:
        rate = min(lay.num_prefill / pre, lay.num_decode / max(dec, 1e-12))
    if mode == "both":
        met = sum(a and b for a, b in zip(ttft_ok, tpot_ok)) / len(requests)
    else:
        met = min(sum(ttft_ok), sum(tpot_ok)) / len(requests)
    room = min(1.0, max(0.0, (met - target) / (1 - target))) if target < 1 else float(met >= 1)
    return max(rate * room, grid_rate(K_MIN)) / lay.gpus


@dataclass(frozen=True)
class PlanSpec:
    """What a plan asks: ``gpus`` at most, tensor-parallel degrees ``tps``, the ``slo`` met
    by ``target`` of the requests in ``mode`` (:data:`MODES`), the conditional and adaptive
    variants of the ``variants`` best splits, the pruned search or ``exhaustive``."""

    gpus: int
    slo: object  # kvxfer.loadgen.metrics.SLO
    tps: tuple[int, ...] = (1,)
    target: float = 0.9
    mode: str = "both"
    variants: int = 1
    exhaustive: bool = False

    def __post_init__(self) -> None:
        if type(self.gpus) is not int or self.gpus < 1:
            raise ValueError(f"--gpus wants an int >= 1, got {self.gpus!r}")
        if not 0 < self.target <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.target}")
        if self.mode not in MODES:
            raise ValueError(f"--attainment-mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        too_big = [k for k in self.tps if k > self.gpus]
        if not self.tps or too_big or any(type(k) is not int or k < 1 for k in self.tps):
            raise ValueError(f"--tp {','.join(map(str, self.tps))}: degrees must be ints in "
                             f"1..{self.gpus} (--gpus)")


def candidates(spec: PlanSpec, profile) -> list[str]:
    """The static configurations a plan searches: :func:`placements` of the profile's
    modes; ``ValueError`` naming the degrees the profile has if ``spec.tps`` asks others."""
    missing = sorted(set(spec.tps) - set(profile.tp_degrees))
    if missing:
        raise ValueError(f"profile {profile.name!r} has tensor-parallel degrees "
                         f"{', '.join(map(str, profile.tp_degrees))}; --tp asked for "
                         f"{', '.join(map(str, missing))}")
    return placements(spec.gpus, spec.tps, profile.engine["modes"])


class Planner:
    """One plan: the slice's ``requests`` (arrivals at time scale 1, with their prompt
    ``hashes``), the ``profile``, the run ``options``; ``runner(jobs)`` runs
    ``(name, grid point)`` jobs, each ``self.probe(job)`` (in worker processes or here),
    and returns their results in order."""

    def __init__(self, spec: PlanSpec, profile, options: RunOptions, requests, hashes=None,
                 runner=None) -> None:
        if len(requests) < 2 or requests[-1][0] <= requests[0][0]:
            raise ValueError("a plan needs at least 2 requests arriving over a time span")
        self.spec, self.profile, self.options = spec, profile, options
        self.requests, self.hashes = requests, hashes
        self.base_rate = len(requests) / (requests[-1][0] - requests[0][0])  # req/s at scale 1
        self.runner = runner or (lambda jobs: [self.probe(j) for j in jobs])
        self.results: dict[tuple, dict] = {}  # (name, k[, "full"]) -> probe result
        self.pruned: dict[str, int] = {}  # name -> the grid point it failed to reach
        self._estimates: dict[str, float] = {}
        self.runs = 0

    # ---- one run ----------------------------------------------------------------------
    def probe(self, job: tuple) -> dict:
        """Run configuration ``name`` at grid point ``k`` (``job`` ``(name, k)``, or
        ``(name, k, "full")`` to run to the end whatever it misses): ``{"rate_rps",
        "passed", "attainment" (None where it stopped early), "stopped"}``."""
        name, k = job[:2]
        rate = grid_rate(k) * gpus_of(name)
        scale = self.base_rate / rate
        t0 = self.requests[0][0]
        requests = [((t - t0) * scale, ids, mt) for t, ids, mt in self.requests]
        watch = (None if job[2:] == ("full",)
                 else SLOWatch(self.spec.slo, self.spec.mode, self.spec.target, len(requests)))
        row = run_config(name, self.options, self.profile, self.spec.slo, requests, self.hashes,
                         routed_hits=False, watch=watch)
        if row.get("stopped"):
            return {"rate_rps": rate, "passed": False, "attainment": None, "stopped": True}
        att = attainment(row["records"], self.spec.slo, self.spec.mode)
        return {"rate_rps": rate, "passed": att >= self.spec.target, "attainment": att,
                "stopped": False, "goodput_rps": row["goodput_rps"],
                "ttft_p50_ms": row["ttft_p50_ms"], "tpot_p50_ms": row["tpot_p50_ms"]}

    # ---- searches ---------------------------------------------------------------------
    def _drive(self, searches: dict[str, object]) -> dict[str, int | None]:
        """Run the capacity searches (generators) side by side: each round, every search's
        next probe, the runner's jobs at once; their results in order."""
        out, pending = {}, {}
        for name, gen in searches.items():
            try:
                pending[name] = (gen, next(gen))
            except StopIteration as stop:
                out[name] = stop.value
        while pending:
            jobs = [(n, k) for n, (_, k) in pending.items() if (n, k) not in self.results]
            if jobs:
                self.runs += len(jobs)
                for job, res in zip(jobs, self.runner(jobs)):
                    self.results[job] = res
            for name in list(pending):
                gen, k = pending[name]
                try:
                    pending[name] = (gen, gen.send(self.results[(name, k)]["passed"]))
                except StopIteration as stop:
                    out[name] = stop.value
                    del pending[name]
        return out

    def guess(self, name: str) -> int:
        """Where a search starts: 60% of :func:`estimate`, on the grid."""
        return max(K_MIN, grid_index(0.6 * self.estimate(name)))

    def estimate(self, name: str) -> float:
        """:func:`estimate` of ``name`` (computed once a plan)."""
        if name not in self._estimates:
            spec = self.spec
            self._estimates[name] = estimate(name, self.profile, self.requests, spec.slo,
                                             spec.target, spec.mode)
        return self._estimates[name]

    def _beats(self, a: tuple, b: tuple | None) -> bool:
        """Whether ranking key ``a`` = (k, gpus, order) beats ``b``."""
        return b is None or (a[0] is not None and (a[0] > (b[0] if b[0] is not None else K_MIN - 1)
                                                   or (a[0] == b[0] and a[1:] < b[1:])))

    def search(self, names: list[str]) -> dict[str, int | None]:
        """Each configuration's capacity (grid point), None where it serves nothing or was
        pruned (it cannot beat the best); exhaustive or branch and bound (module docstring)."""
        order = {n: i for i, n in enumerate(names)}
        key = {n: (gpus_of(n), order[n]) for n in names}
        if self.spec.exhaustive:
            return self._drive({n: capacity_probes(self.guess(n)) for n in names})
        ranked = sorted(names, key=lambda n: -self.estimate(n))
        found: dict[str, int | None] = {}
        best = None  # (k, gpus, order)
        width = max(1, getattr(self.runner, "jobs", 1))
        for i in range(0, len(ranked), width):
            batch, searches = ranked[i:i + width], {}
            for n in batch:
                if best is None:
                    searches[n] = capacity_probes(self.guess(n))
                else:  # the point it must pass to beat the best: a tie wins on fewer GPUs
                    need = best[0] if key[n] < best[1:] else best[0] + 1
                    searches[n] = capacity_probes(self.guess(n), threshold=need)
            found.update(self._drive(searches))
            for n in batch:
                if best is not None and found[n] is None:
                    self.pruned[n] = best[0] if key[n] < best[1:] else best[0] + 1
                if found[n] is not None and self._beats((found[n], *key[n]), best):
                    best = (found[n], *key[n])
        return found

    def plan(self) -> dict:
        """The whole plan: ``{"best", "best_per_gpu_rate_rps", "configs": [...], "runs"}``;
        each config ``{"name", "gpus", "max_rate_rps", "per_gpu_rate_rps", "pruned",
        "probes"}`` (rates None where none passed or it was pruned)."""
        spec = self.spec
        names = candidates(spec, self.profile)
        found = self.search(names)
        ranked = self._ranked(names, found)
        splits = [n for n in ranked if layout_of(n).kind == "static" and found[n] is not None]
        variants = []
        if self.profile.engine["handoff"] == "reserve-first":  # DistServe's engine has none
            for n in splits[:max(spec.variants, 0)]:
                lay = layout_of(n)
                variants += [canonical(f"conditional:{n}")]
                if lay.num_prefill + lay.num_decode >= 3:
                    variants += [canonical(f"adaptive:{n}")]
        if variants:
            best = ranked[0]
            for v in variants:  # each against the best: as the pruned search tests any other
                need = found[best] if gpus_of(v) < gpus_of(best) else found[best] + 1
                found.update(self._drive({v: capacity_probes(need, threshold=need)}))
                if found[v] is None:
                    self.pruned[v] = need
            names += variants
            ranked = self._ranked(names, found)
        rows = [self._row(n, found[n]) for n in names]
        best = ranked[0] if found[ranked[0]] is not None else None
        return {"best": best,
                "best_per_gpu_rate_rps": None if best is None else grid_rate(found[best]),
                "configs": rows, "runs": self.runs}

    def _ranked(self, names: list[str], found: dict) -> list[str]:
        order = {n: i for i, n in enumerate(names)}
        return sorted(names, key=lambda n: (-(found[n] if found[n] is not None else K_MIN - 1),
                                            gpus_of(n), order[n]))

    def _row(self, name: str, k: int | None) -> dict:
        probes = sorted((job[1], res) for job, res in self.results.items()
                        if job[0] == name and len(job) == 2)
        row = {"name": name, "gpus": gpus_of(name),
               "max_rate_rps": None if k is None else grid_rate(k) * gpus_of(name),
               "per_gpu_rate_rps": None if k is None else grid_rate(k),
               "pruned": name in self.pruned,
               "probes": [{"per_gpu_rate_rps": grid_rate(kk), **res} for kk, res in probes]}
        if name in self.pruned:  # below this per-GPU rate: it cannot beat the best
            row["below_per_gpu_rate_rps"] = grid_rate(self.pruned[name])
        return row

    def curves(self, names: list[str], points: list[int]) -> dict[str, list[dict]]:
        """Attainment against the per-GPU rate (DistServe's Figure 8): each of ``names`` run
        to the end at each grid point of ``points``; ``{name: [{"per_gpu_rate_rps",
        "rate_rps", "attainment", ...}, ...]}``."""
        jobs = [(n, k, "full") for n in names for k in points]
        todo = [j for j in jobs if j not in self.results]
        self.runs += len(todo)
        for job, res in zip(todo, self.runner(todo) if todo else []):
            self.results[job] = res
        return {n: [{"per_gpu_rate_rps": grid_rate(k), **self.results[(n, k, "full")]}
                    for k in points] for n in names}


_PLANNER: Planner | None = None  # the plan a forked worker process runs probes of


def _probe(job: tuple) -> dict:
    return _PLANNER.probe(job)


class ProcessRunner:
    """A :class:`Planner`'s runner: ``jobs`` probes at a time, one forked process each (they
    inherit the slice and its prompts' hashes); in this process when ``jobs`` is 1."""

    def __init__(self, jobs: int) -> None:
        if type(jobs) is not int or jobs < 1:
            raise ValueError(f"--jobs must be an int >= 1, got {jobs!r}")
        self.jobs, self.pool = jobs, None

    def bind(self, planner: Planner) -> None:
        global _PLANNER
        _PLANNER = planner

    def __call__(self, jobs: list) -> list[dict]:
        if self.jobs <= 1 or len(jobs) <= 1:
            return [_PLANNER.probe(j) for j in jobs]
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("fork"))
        return list(self.pool.map(_probe, jobs))

    def close(self) -> None:
        global _PLANNER
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None
        _PLANNER = None
