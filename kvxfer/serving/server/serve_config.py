"""The server's frozen configuration, built once by ``kvxfer serve`` and passed down.

Worker naming and CPU assignment live here so the launcher, the router and the
tests agree on them: prefill workers come first (``prefill-0``, ...), then
decode workers (``decode-0``, ...), or only ``colocated-0``, ...
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...secrets import has_secret
from ..engine.config import SCHEDULES, EngineConfig
from ..model.config import MATMUL_DTYPES
from .adaptive_policy import AdaptivePolicy
from .routing import OVERLAP_WEIGHT
from .routing import POLICIES as ROUTING_POLICIES

TRANSFER_POLICIES = ("fail", "recompute")
ENGINES = ("real", "sim")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process: its name, role, pinned CPUs (None: not pinned), threads, and
    the tensor-parallel degree it models (``--engine sim``: GPUs it stands for)."""

    name: str
    role: str  # "prefill" | "decode" | "colocated"
    cpus: tuple[int, ...] | None
    num_threads: int
    tp: int = 1


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``kvxfer serve`` decides before starting processes.

    ``cpu_groups``: one CPU group per worker (in :meth:`worker_specs` order), or
    a single group shared by all, or empty (no pinning; threads split the
    machine's cores evenly). ``tp_degrees``: the same for the tensor-parallel degree
    each simulated worker models (empty: 1). ``num_blocks`` None: each worker's pool
    is its profile's KV capacity at its degree (``--engine sim``), else the engine's default.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    model_path: str | None = None
    cpu_groups: tuple[tuple[int, ...], ...] = ()
    on_transfer_failure: str = "recompute"
    num_threads: int | None = None  # torch threads per worker; None: sized to its CPUs
    num_blocks: int | None = None  # None: the profile's capacity (--engine sim), else the engine's
    tp_degrees: tuple[int, ...] = ()  # --engine sim: per worker (or one for all)
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    schedule: str = EngineConfig.schedule  # of every worker
    matmul_dtype: str = EngineConfig.matmul_dtype  # of every worker (auto: by CPU)
    local_prefill_tokens: int = 0  # prefill uncached prompts shorter than this on the decode worker
    local_prefill_queue: int = 0  # ... and every prompt while the prefill worker holds this many
    prefill_nice: int = 0  # prefill workers run at +N nice (lower priority) than decode workers
    startup_timeout_s: float = 300.0
    transfer_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    api_key: str | None = field(default=None, repr=False)  # bearer token for /v1/* and /metrics
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    # HTTP connection limits (kvxfer.serving.server.http_limits)
    header_timeout_s: float = 10.0  # headers not complete by then: connection closed
    body_timeout_s: float = 30.0  # body not complete this long after the headers: 408
    keep_alive_timeout_s: float = 5.0  # idle keep-alive connections are closed
    limit_concurrency: int = 512  # open connections (idle-header ones evicted) and in-flight requests (503 beyond)
    max_connections_per_source: int = 64  # open connections of one client address (idle-header ones evicted)
    discovery: str | None = None  # etcd://... or static://...: workers found, not spawned
    secret_file: str | None = None  # discovery mode and --store: else KVXFER_SECRET
    store: str | None = None  # --store: the KV pool prefill workers read and fill (etcd URL or nodes)
    restart_workers: bool = True  # supervise: start a dead worker again (launcher.py)
    restart_backoff_s: float = 1.0  # first delay; doubles per quick death
    restart_backoff_max_s: float = 30.0
    worker_env: tuple[tuple[str, str], ...] = field(default=())  # extra env (test hooks)
    adaptive: AdaptivePolicy | None = None  # --adaptive: move workers between P and D
    adaptive_slo_ms: tuple[float, float] | None = None  # (TTFT, TPOT) the rebalancer watches
    retries: int = 0  # place a request again this often if its worker dies before token 0
    routing: str = "least-loaded"  # the worker-picking policy (kvxfer.serving.server.routing)
    routing_load_gap: int = 4  # --routing kv: a prefix hit draws requests up to this over the least load
    routing_overlap_weight: float = OVERLAP_WEIGHT  # --routing kv: a block to prefill vs one held
    engine: str = "real"  # "sim": every worker runs the simulated engine (kvxfer.sim)
    profile: str | None = None  # --engine sim: the cost profile, a shipped name or a file
    sim_kv_scale: float | None = None  # --engine sim: real block bytes / simulated pool block bytes
    step_log_dir: str | None = None  # --step-log: workers log their steps to DIR/NAME.jsonl
    sim_devices: int | None = None  # --engine sim: the workers share this many modelled devices

    def __post_init__(self) -> None:
        if self.store is not None and not self.discovery and not has_secret(self.secret_file):
            raise ValueError("--store needs the store nodes' secret: $KVXFER_SECRET or --secret-file")
        if self.store is not None and self.num_colocated:
            raise ValueError("--store: prefill workers use the pool; --colocated has none")
        if self.on_transfer_failure not in TRANSFER_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {TRANSFER_POLICIES}")
        if self.num_colocated < 0 or self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("worker counts must be >= 0")
        if self.discovery:
            if self.num_colocated or self.num_prefill or self.num_decode:
                raise ValueError("--discovery: workers are started with `kvxfer worker`")
        elif self.num_colocated:
            if self.num_prefill or self.num_decode:
                raise ValueError("--colocated excludes --prefill/--decode")
        elif self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("disaggregated serving needs >= 1 prefill and >= 1 decode worker")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, "
                             f"got {self.matmul_dtype!r}")
        if self.local_prefill_tokens < 0 or self.local_prefill_queue < 0:
            raise ValueError("local prefill thresholds must be >= 0 (0: off)")
        if type(self.prefill_nice) is not int or not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be an int in [0, 19], got {self.prefill_nice!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if type(self.limit_concurrency) is not int or self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be an int >= 1, got {self.limit_concurrency!r}")
        if type(self.max_connections_per_source) is not int or self.max_connections_per_source < 1:
            raise ValueError(f"max_connections_per_source must be an int >= 1, "
                             f"got {self.max_connections_per_source!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        num_workers = self.num_colocated or self.num_prefill + self.num_decode
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {sorted(ROUTING_POLICIES)}, got {self.routing!r}")
        if type(self.routing_load_gap) is not int or self.routing_load_gap < 0:
            raise ValueError(f"routing_load_gap must be an int >= 0, got {self.routing_load_gap!r}")
        if not 0 <= self.routing_overlap_weight < float("inf"):
            raise ValueError("routing_overlap_weight must be a finite number >= 0, got "
                             f"{self.routing_overlap_weight!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if (self.engine == "sim") != (self.profile is not None):
            raise ValueError("--engine sim needs --profile (and --profile needs --engine sim)")
        if self.sim_devices is not None:
            if type(self.sim_devices) is not int or self.sim_devices < 1:
                raise ValueError(f"sim_devices must be an int >= 1, got {self.sim_devices!r}")
            if self.engine != "sim":
                raise ValueError("--sim-devices shares modelled devices: it needs --engine sim")
        if self.adaptive is not None:
            if self.discovery or self.num_colocated:
                raise ValueError("--adaptive moves local prefill/decode workers: not with "
                                 "--colocated or --discovery")
            if num_workers < 3:
                raise ValueError("--adaptive needs at least 3 workers (a role is never left empty)")
            if self.prefill_nice:
                raise ValueError("--prefill-nice is set when a worker starts; --adaptive moves "
                                 "workers between roles: not both")
        if self.adaptive_slo_ms is not None and not all(v > 0 for v in self.adaptive_slo_ms):
            raise ValueError("adaptive SLO values must be > 0")
        if len(self.tp_degrees) not in (0, 1, num_workers) or any(
                type(k) is not int or k < 1 for k in self.tp_degrees):
            raise ValueError(f"tp_degrees: ints >= 1, one or one per worker ({num_workers}), "
                             f"got {self.tp_degrees!r}")
        if self.num_blocks is not None and (type(self.num_blocks) is not int or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an int >= 1 or None, got {self.num_blocks!r}")
        if len(self.cpu_groups) not in (0, 1, num_workers):
            raise ValueError(f"--cpus: give 1 group or one per worker ({num_workers}), "
                             f"got {len(self.cpu_groups)}")

    @property
    def is_disaggregated(self) -> bool:
        return self.num_colocated == 0

    def worker_specs(self) -> list[WorkerSpec]:
        if self.discovery:
            return []
        names = ([f"colocated-{i}" for i in range(self.num_colocated)] if self.num_colocated
                 else [f"prefill-{i}" for i in range(self.num_prefill)]
                 + [f"decode-{i}" for i in range(self.num_decode)])
        specs = []
        for i, name in enumerate(names):
            if not self.cpu_groups:
                cpus, threads = None, max(1, (os.cpu_count() or 1) // len(names))
            elif len(self.cpu_groups) == 1:
                cpus = self.cpu_groups[0]
                threads = max(1, len(cpus) // len(names))
            else:
                cpus = self.cpu_groups[i]
                threads = len(cpus)
            if self.num_threads is not None:
                threads = self.num_threads
            tp = self.tp_degrees[i if len(self.tp_degrees) > 1 else 0] if self.tp_degrees else 1
            specs.append(WorkerSpec(name, name.rsplit("-", 1)[0], cpus, threads, tp))
        return specs

    def routing_policy(self):
        """A new :mod:`~kvxfer.serving.server.routing` policy as ``routing`` names it, for
        the workers' blocks of ``EngineConfig.block_size`` tokens."""
        from .routing import make_policy

        knobs = ({"load_gap": self.routing_load_gap, "overlap_weight": self.routing_overlap_weight}
                 if self.routing == "kv" else {})
        return make_policy(self.routing, EngineConfig.block_size, **knobs)
