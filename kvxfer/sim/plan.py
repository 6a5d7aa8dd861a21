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
bound: configurations in order of an optimistic estimate (:meth:`Planner.estimate`), each
first run once at the rate per GPU it would need to beat the best so far; only one that
passes is searched further. With attainment falling in the rate, that is the
exhaustive search's pick (each configuration searched in full), at a fraction of the runs.
Both give no run to a configuration where too few requests can meet the SLO even with
the workers to themselves (:meth:`Planner.feasible`, from :class:`Alone`'s lower bounds):
it serves nothing at any rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..serving.engine.config import EngineConfig
from .configs import canonical, gpus_of, layout_of, placements
from .replay import RunOptions, run_config

MODES = ("both", "each")
STEP = 1.05  # the rate grid's ratio: a capacity is found to within 5%
K_MIN = -100  # 1.05 ** -100 = 0.0076 req/s a GPU: below it, a configuration serves nothing


def grid_rate(k: int) -> float:
    """Per-GPU rate (req/s) of grid point ``k``."""
    return STEP ** k


CURVE_POINTS = (-24, -16, -10, -6, -3, 0, 3, 6)  # grid steps (5%) around the best's capacity


def grid_index(per_gpu_rate: float) -> int:
    """The highest grid point at or below ``per_gpu_rate``."""
    k = math.floor(math.log(per_gpu_rate) / math.log(STEP))
    return k + 1 if grid_rate(k + 1) <= per_gpu_rate else k


class SLOWatch:
    """Counts a run's SLO misses as soon as each is certain (the virtual clock's ``watch``,
    :mod:`kvxfer.sim.vclock`): a request without its first token by its TTFT deadline, or
    not done by its first token's time plus TPOT x (tokens - 1), has missed. True once
    ``target`` of ``num_requests`` can no longer be met. A refused request misses both."""

    MARGIN_S = 1e-9  # past a deadline by this: a miss whatever the float rounding

    def __init__(self, slo, mode: str, target: float, num_requests: int) -> None:
        self.ttft_ms, self.tpot_ms = slo.ttft_ms, slo.tpot_ms  # compared as SLO.met does
        self.mode = mode
        # at most this many misses (of each SLO, or of either) still reach the target
        self.allowed = num_requests - math.ceil(target * num_requests - 1e-9)
        self.missed = {"ttft": set(), "tpot": set(), "both": set()}

    def due(self, r, first: bool) -> float | None:
        """When ``r`` has missed its TTFT (``first`` False: from its arrival) or its TPOT
        (from its first token) if its first token, or its end, has not come."""
        if not first:
            return r.arrival_s + self.ttft_ms / 1e3 + self.MARGIN_S
        if r.max_tokens < 2:
            return None
        return r.token_times[0] + self.tpot_ms / 1e3 * (r.max_tokens - 1) + self.MARGIN_S

    def late(self, r, which: str) -> bool:
        """``r`` missed ``which`` (``"ttft"`` or ``"tpot"``): whether the run can stop."""
        self.missed[which].add(r.rid)
        self.missed["both"].add(r.rid)
        return self._out_of_reach()

    def __call__(self, r, done: bool) -> bool:
        times = r.token_times
        if not times:  # refused: longer than a pool
            return self.late(r, "ttft") or self.late(r, "tpot")
        if not done:
            if (times[0] - r.arrival_s) * 1e3 > self.ttft_ms:
                return self.late(r, "ttft")
        elif len(times) > 1 and (times[-1] - times[0]) / (len(times) - 1) * 1e3 > self.tpot_ms:
            return self.late(r, "tpot")
        return False

    def _out_of_reach(self) -> bool:
        if self.mode == "both":
            return len(self.missed["both"]) > self.allowed
        return len(self.missed["ttft"]) > self.allowed or len(self.missed["tpot"]) > self.allowed


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
    test); ``passes_at``: a point known to pass. Otherwise it starts at ``guess`` (after
    a failure there, ``K_MIN`` next: a configuration that serves nothing costs two runs),
    steps by doubling strides to a bracket, then bisects it."""
    lo = passes_at  # highest known pass
    hi = None  # lowest known fail
    if threshold is not None and lo is None:
        if not (yield threshold):
            return None
        lo = threshold
    if lo is None:
        if (yield guess):
            lo = guess
        elif guess <= K_MIN or not (yield K_MIN):  # serves nothing: known in one more run
            return None
        else:
            lo, hi, stride = K_MIN, guess, 1
            while hi - lo > 1:
                k = hi - stride
                if k <= lo:
                    break
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


class Alone:
    """What each request costs at least on a worker of one tensor-parallel degree,
    whatever else runs (every cost-model term is >= 0, and a step costs at least its own
    chunks' terms): ``ttft_s``, its prefill of the tokens no earlier prompt could have
    cached (``cached``: leading tokens that may be hits); ``tpot_s``, the cheapest step
    that can carry its decode (a one-token chunk at its first context, in any of the
    fit's step forms; 0 for a one-token answer); ``prefill_s``/``decode_s``, its prefill
    and decode work at the best batching the fit allows (per-step constants left out)."""

    def __init__(self, profile, tp: int, requests, cached: list[int]) -> None:
        fit = profile.at_tp(tp).fit
        k = fit.coefficients
        # a decode step's (d, e) and the fewest sequences it carries, in each batch fit
        forms = [(k[4], k[5], 1)]
        if fit.large_batch is not None:
            forms.append((fit.large_batch[1], fit.large_batch[2], fit.large_batch_from))
        bases = [k[3], k[0]] + ([fit.large_batch[0]] if fit.large_batch is not None else [])
        d_best, e_best = min(d for d, _, _ in forms), min(e for _, e, _ in forms)
        self.ttft_s, self.tpot_s, self.prefill_s, self.decode_s = [], [], [], []
        for (_, ids, max_tokens), hit in zip(requests, cached):
            n, p = len(ids) - hit, hit
            # the causal pairs: at most what either attention form counts
            work = k[1] * n + k[2] * n * (p + n / 2)
            self.ttft_s.append(k[0] + work)
            self.prefill_s.append(work)
            ctx = len(ids) + 1
            cheapest = min(bases) + min(d * b + e * ctx for d, e, b in forms)
            self.tpot_s.append(cheapest if max_tokens > 1 else 0.0)
            self.decode_s.append(max(max_tokens - 1, 0) * (d_best + e_best * (ctx + max_tokens / 2)))


def cached_prefixes(requests, hashes: list[list[int]], block_size: int) -> list[int]:
    """Per request, the leading tokens an earlier request's prompt could have left in a
    prefix cache (its leading full blocks whose chained hashes came before), the last
    token always left to compute."""
    seen, out = set(), []
    for (_, ids, _), chain in zip(requests, hashes):
        k = 0
        while k < len(chain) and chain[k] in seen:
            k += 1
        out.append(min(k * block_size, len(ids) - 1))
        seen.update(chain)
    return out


@dataclass(frozen=True)
class PlanSpec:
    """What a plan asks: ``gpus`` at most, tensor-parallel degrees ``tps``, the ``slo`` met
    by ``target`` of the requests in ``mode`` (:data:`MODES`), the conditional and adaptive
    variants of the ``variants`` best splits, the pruned search or ``exhaustive``; only
    ``configs`` where given (else every placement)."""

    gpus: int
    slo: object  # kvxfer.loadgen.metrics.SLO
    tps: tuple[int, ...] = (1,)
    target: float = 0.9
    mode: str = "both"
    variants: int = 1
    exhaustive: bool = False
    configs: tuple[str, ...] = ()

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
        names = tuple(canonical(n) for n in self.configs)  # ConfigError outside the grammar
        over = [n for n in names if gpus_of(n) > self.gpus]
        if over:
            raise ValueError(f"--config {', '.join(over)}: more than --gpus {self.gpus} GPUs")
        object.__setattr__(self, "configs", names)


def candidates(spec: PlanSpec, profile) -> list[str]:
    """The configurations a plan searches: ``spec.configs``, or :func:`placements` of the
    profile's modes; ``ValueError`` naming the degrees the profile has if ``spec.tps`` (or
    a configuration) asks others."""
    if spec.configs:
        for name in spec.configs:
            lay = layout_of(name)
            for tp in {lay.prefill_tp, lay.decode_tp}:
                profile.at_tp(tp)  # ProfileError (a ValueError) naming the degrees it has
            profile.check_mode("colocated" if lay.kind == "colocated" else "split")
        return list(spec.configs)
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
        self._alone: dict[int, Alone] = {}
        self._cached: list[int] | None = None
        self.infeasible: set[str] = set()  # no run: too few requests can meet the SLO alone
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
        """Where a search starts: 60% of :meth:`estimate`, on the grid."""
        return max(K_MIN, grid_index(0.6 * self.estimate(name)))

    def alone(self, tp: int) -> Alone:
        if tp not in self._alone:
            if self._cached is None:
                from .vclock import prompt_hashes

                size = self.profile.block_size
                hashes = self.hashes or prompt_hashes(self.requests, size)
                self._cached = cached_prefixes(self.requests, hashes, size)
            self._alone[tp] = Alone(self.profile, tp, self.requests, self._cached)
        return self._alone[tp]

    def _met(self, name: str) -> tuple[int, int, int]:
        """Requests that can meet TTFT, TPOT and both at any rate (:class:`Alone`; a request
        longer than the smallest pool meets neither)."""
        lay = layout_of(name)
        slo = self.spec.slo
        pre, dec = self.alone(lay.prefill_tp), self.alone(lay.decode_tp)
        pool = min(self.options.num_blocks or self.profile.at_tp(tp).default_num_blocks(
            EngineConfig.num_blocks) for tp in {lay.prefill_tp, lay.decode_tp}) * self.profile.block_size
        ttft = tpot = both = 0
        for i, (_, ids, max_tokens) in enumerate(self.requests):
            if len(ids) + max_tokens > pool:
                continue
            a = pre.ttft_s[i] * 1e3 <= slo.ttft_ms
            b = dec.tpot_s[i] * 1e3 <= slo.tpot_ms
            ttft, tpot, both = ttft + a, tpot + b, both + (a and b)
        return ttft, tpot, both

    def feasible(self, name: str) -> bool:
        """Whether ``name`` could reach the target at some rate: False only where too few
        requests can meet the SLO even alone (a static or colocated configuration; the
        others: True). A configuration that cannot is given no run."""
        if layout_of(name).kind not in ("static", "colocated"):
            return True
        ttft, tpot, both = self._met(name)
        need = math.ceil(self.spec.target * len(self.requests) - 1e-9)
        return (both if self.spec.mode == "both" else min(ttft, tpot)) >= need

    def estimate(self, name: str) -> float:
        """An optimistic guess of ``name``'s capacity per GPU (req/s), to order the pruned
        search and seed each bisection (nothing relies on it being right): the rate at
        which its busier pool is fully busy (:class:`Alone`'s work), scaled down by how
        little room the SLO leaves even alone (the share that can meet it, over the target)."""
        if name in self._estimates:
            return self._estimates[name]
        lay = layout_of(name)
        n = len(self.requests)
        pre = sum(self.alone(lay.prefill_tp).prefill_s) / n
        dec = sum(self.alone(lay.decode_tp).decode_s) / n
        if lay.kind == "colocated":
            rate = lay.num_prefill / max(pre + dec, 1e-12)
        else:
            rate = min(lay.num_prefill / max(pre, 1e-12), lay.num_decode / max(dec, 1e-12))
        ttft, tpot, both = self._met(name)
        met = (both if self.spec.mode == "both" else min(ttft, tpot)) / n
        target = self.spec.target
        room = min(1.0, max(0.0, (met - target) / (1 - target))) if target < 1 else float(met >= 1)
        self._estimates[name] = out = max(rate * room, grid_rate(K_MIN)) / lay.gpus
        return out

    def _beats(self, a: tuple, b: tuple | None) -> bool:
        """Whether ranking key ``a`` = (k, gpus, order) beats ``b``."""
        return b is None or (a[0] is not None and (a[0] > (b[0] if b[0] is not None else K_MIN - 1)
                                                   or (a[0] == b[0] and a[1:] < b[1:])))

    def search(self, names: list[str]) -> dict[str, int | None]:
        """Each configuration's capacity (grid point), None where it serves nothing or was
        pruned (it cannot beat the best); exhaustive or branch and bound (module docstring)."""
        order = {n: i for i, n in enumerate(names)}
        key = {n: (gpus_of(n), order[n]) for n in names}
        found: dict[str, int | None] = {}
        for n in names:
            if not self.feasible(n):
                self.infeasible.add(n)
                found[n] = None
        names = [n for n in names if n not in self.infeasible]
        if self.spec.exhaustive:
            return {**found, **self._drive({n: capacity_probes(self.guess(n)) for n in names})}
        ranked = sorted(names, key=lambda n: -self.estimate(n))
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
               "pruned": name in self.pruned, "infeasible": name in self.infeasible,
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

    def best_curves(self, doc: dict, top: int) -> dict[str, list[dict]]:
        """:meth:`curves` of the ``top`` configurations of a :meth:`plan` document (by
        capacity per GPU), at :data:`CURVE_POINTS` around the best's capacity; ``{}``
        where nothing met the SLO."""
        if doc["best"] is None:
            return {}
        ranked = [r for r in sorted(doc["configs"], key=lambda r: -(r["per_gpu_rate_rps"] or 0))
                  if r["per_gpu_rate_rps"]][:max(top, 1)]
        k = grid_index(doc["best_per_gpu_rate_rps"])
        return self.curves([r["name"] for r in ranked], [k + d for d in CURVE_POINTS])


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
