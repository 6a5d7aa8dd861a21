"""A trace slice replayed on one configuration: what ``kvxfer simulate`` runs, and each
run ``kvxfer plan`` makes.

:class:`TraceSlice` reads a Mooncake-format trace as ``kvxfer loadgen`` sends it
(``--start``, ``--max-requests``, ``--time-scale``, ``--length-scale``, ``--output-scale``,
``--arrival-jitter-ms``, ``--seed``); :class:`RunOptions` holds the engine and router
settings, with the profile's engine as the default for what is not given
(:meth:`RunOptions.engine_fields`); :func:`run_config` runs one configuration on the
virtual clock (:func:`kvxfer.sim.vclock.simulate`) and scores it with ``kvxfer
loadgen``'s metrics (:func:`kvxfer.loadgen.metrics.summarize_run`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..serving.engine.config import EngineConfig
from ..serving.server.adaptive_policy import AdaptivePolicy


@dataclass(frozen=True)
class TraceSlice:
    """A slice of a Mooncake-format trace (``{"timestamp", "input_length",
    "output_length", "hash_ids"}`` lines), read as ``kvxfer loadgen`` reads it."""

    path: str
    start: int = 0
    max_requests: int | None = None
    time_scale: float = 1.0  # multiplies the timestamps (0.1 = 10x the rate)
    length_scale: float = 1.0
    output_scale: float | None = None  # default: length_scale
    jitter_ms: float = 0.0  # each arrival spread within this window (seed)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {self.time_scale}")

    def arrivals(self, time_scale: float | None = None) -> list[tuple[float, list[int], int]]:
        """``(arrival_s, prompt_ids, max_tokens)`` per request, prompts built as ``kvxfer
        loadgen`` builds them (:class:`kvxfer.loadgen.prompts.PromptBuilder`: one id a
        word, hash id ``h``'s block the same ids wherever it appears); ``time_scale``
        replaces the slice's. ``ValueError`` for an unreadable trace."""
        from ..loadgen.prompts import PromptBuilder
        from ..loadgen.trace import jitter, read_trace

        scale = self.time_scale if time_scale is None else time_scale
        if not scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {scale}")
        try:
            reqs = read_trace(self.path, start=self.start, max_requests=self.max_requests)
        except OSError as exc:
            raise ValueError(f"cannot read trace {self.path}: {exc.strerror}") from None
        if self.jitter_ms:  # as kvxfer loadgen spreads them (sorted by the new time)
            reqs = jitter(reqs, self.jitter_ms, seed=self.seed)
        prompts = PromptBuilder(length_scale=self.length_scale, output_scale=self.output_scale)
        return [(r.timestamp_ms * scale / 1e3, prompts.prompt_ids(r), prompts.max_tokens(r))
                for r in reqs]


@dataclass(frozen=True)
class RunOptions:
    """How a configuration runs: routing, KV pool, shared devices, engine budgets (None:
    the profile's, :meth:`engine_fields`), chunked prefill or whole prompts first
    (``chunked_prefill=False``: vLLM's ``--no-enable-chunked-prefill``), the rebalancer's
    policy of ``adaptive:`` configurations."""

    routing: str = "least-loaded"
    routing_knobs: tuple[tuple[str, float], ...] = ()  # --routing kv: load_gap, overlap_weight
    store: object = None  # kvxfer.sim.store.StoreSpec or None
    sim_devices: int | None = None
    num_blocks: int | None = None  # None: each worker's profile capacity at its TP
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = True
    adaptive: AdaptivePolicy = field(default_factory=AdaptivePolicy)

    def engine_fields(self, profile) -> dict:
        """The :class:`ServeConfig` engine fields for ``profile``: what is given, else the
        profiled engine's (``max_num_seqs``; ``chunked_prefill_tokens`` or, without chunked
        prefill, ``max_num_batched_tokens``), else kvxfer's engine defaults. An engine
        without chunked prefill (DistServe's) runs whole prompts whatever is asked."""
        eng = profile.engine
        chunked = self.chunked_prefill and eng.get("chunked_prefill", True)
        budget = eng.get("chunked_prefill_tokens" if chunked else "max_num_batched_tokens",
                         EngineConfig.max_num_batched_tokens)
        fields = dict(num_blocks=self.num_blocks,
                      max_num_seqs=self.max_num_seqs or eng.get("max_num_seqs", EngineConfig.max_num_seqs),
                      max_num_batched_tokens=self.max_num_batched_tokens or budget,
                      schedule="mixed" if chunked else "prefill-first")
        if self.sim_devices is not None:
            fields.update(engine="sim", profile=profile.name, sim_devices=self.sim_devices)
        return fields


def run_config(name: str, options: RunOptions, profile, slo, requests, hashes=None, *,
               twin: bool = False, routed_hits: bool = True, watch=None) -> dict:
    """One configuration on the virtual clock: ``{"name", "goodput_rps", "slo_attainment",
    "summary", ...}``; ``goodput_rps`` and attainment are None without an SLO. ``hashes``:
    :func:`kvxfer.sim.vclock.prompt_hashes` of ``requests`` (computed once for many runs).
    ``twin`` (a static ``xPyD`` of >= 3 workers): the run also watches ``adaptive:xPyD``'s
    rebalancer (:func:`kvxfer.sim.vclock.simulate`); ``row["twin"]`` is that configuration's
    row where its rebalancer never moved a worker (the same run), else None.
    ``routed_hits=False``: ``routed_hit_ratio`` is None where the policy does not pick by
    prefix (a cheaper run). ``watch``: as :func:`~kvxfer.sim.vclock.simulate`'s; a run it
    stopped returns ``{"name", "stopped": True, "virtual_s"}`` only."""
    from ..loadgen.metrics import summarize_run
    from .configs import layout_of, parse_config
    from .vclock import simulate

    profile.check_mode("colocated" if layout_of(name).kind == "colocated" else "split")
    engine = options.engine_fields(profile)
    slo_ms = (slo.ttft_ms, slo.tpot_ms) if slo else None
    config = parse_config(name, slo_ms=slo_ms, adaptive=options.adaptive, **engine)
    twin_config = (parse_config(f"adaptive:{name}", slo_ms=slo_ms, adaptive=options.adaptive,
                                **engine) if twin else None)
    result = simulate(config, profile, requests, routing=options.routing, prompt_hashes=hashes,
                      twin=twin_config, routed_hits=routed_hits, store=options.store, watch=watch,
                      **dict(options.routing_knobs))
    if result.stopped:
        return {"name": name, "stopped": True, "virtual_s": result.end_s}
    summary = summarize_run(result.records, slo)
    row = _row(name, summary, result, result.end_s)
    if twin:
        row["twin"] = (None if result.twin_end_s is None
                       else _row(f"adaptive:{name}", summary, result, result.twin_end_s,
                                 dict(result.counters)))
    return row


def _row(name: str, summary: dict, result, end_s: float, counters: dict | None = None) -> dict:
    counts = result.counters if counters is None else counters
    return {"name": name, "goodput_rps": summary.get("goodput"),
            "slo_attainment": summary.get("slo_attainment"),
            "request_throughput": summary["request_throughput"],
            "ttft_p50_ms": summary["ttft_ms"]["median"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tpot_p50_ms": summary["tpot_ms"]["median"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "prefix_hit_ratio": (counts["hit_tokens"] / counts["query_tokens"]
                                 if counts.get("query_tokens") else 0.0),
            "routed_hit_ratio": (None if "routed_prompt_blocks" not in counts
                                 else counts["routed_hit_blocks"] / counts["routed_prompt_blocks"]
                                 if counts["routed_prompt_blocks"] else 0.0),
            # prompt tokens prefill workers loaded from the KV pool (--store), else None
            "store_hit_tokens": counts.get("store_hit_tokens"),
            "virtual_s": end_s, "counters": counts, "records": result.records}


def best_of(rows: list[dict]) -> str:
    """The name of the row with the highest goodput (request throughput without an SLO)."""
    key = "goodput_rps" if rows[0]["goodput_rps"] is not None else "request_throughput"
    return max(rows, key=lambda r: r[key])["name"]
