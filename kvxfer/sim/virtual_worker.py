"""The virtual clock's parts: a simulated worker, a request's record, a run's result.

:class:`SimWorker` is one worker of the cluster :mod:`kvxfer.sim.vclock` runs: the
router's view of it (:class:`WorkerRef`) and its engine (:class:`VirtualRuntime`: the
real scheduler and block manager, a step's time the profile's at the worker's
tensor-parallel degree), with its modelled links: one NIC queue across nodes and one
within its node (NVLink), each ``tp`` GPUs wide. :func:`place_on_nodes` puts the
workers' GPUs on nodes, which decides the link of each transfer.
"""
from __future__ import annotations

import collections
import contextlib
import gc
from dataclasses import dataclass, field

from ..serving.engine.config import EngineConfig
from ..serving.engine.runtime import Runtime
from ..serving.engine.scheduler import ScheduledChunk
from ..serving.engine.sequence import Sequence
from ..serving.server.worker_ref import WorkerRef
from ..serving.workers.pool import PrefillPool
from ..serving.simulated.link import NicQueue
from ..serving.simulated.profile import Profile
from ..serving.simulated.runtime import next_token


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off inside (restored after). The virtual clock makes
    many short-lived containers and no reference cycles: the collector would only scan
    them, about a tenth of a run's time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class VirtualRuntime(Runtime):
    """The engine core with no model and no pool: a step's time is the profile's model
    (:attr:`last_step_s`), its tokens :func:`kvxfer.serving.simulated.runtime.next_token`'s."""

    def __init__(self, config: EngineConfig, profile: Profile) -> None:
        if config.block_size != profile.block_size:
            raise ValueError(f"the profile {profile.name!r} was fitted with block size "
                             f"{profile.block_size}, the engine uses {config.block_size}")
        super().__init__(None, config)
        self.profile = profile
        self.last_step_s = 0.0
        self._step_seconds = profile.fit.step_seconds
        # a swapped block's time each way: its bytes over the tp GPUs' host links
        swap_bw = profile.engine.get("swap_bytes_per_s")
        self._swap_s = profile.block_bytes / (swap_bw * profile.tp) if swap_bw else 0.0

    def _forward(self, chunks: list[ScheduledChunk]):
        self.last_step_s = self._step_seconds([(c.num_tokens, c.start) for c in chunks])
        swapped = self.scheduler.num_swap_blocks
        if swapped:  # the swaps this schedule made run before the step
            self.scheduler.num_swap_blocks = 0
            self.last_step_s += swapped * self._swap_s
        return self._pick

    @staticmethod
    def _pick(row: int, seq: Sequence) -> tuple[int, None]:
        ids = seq.token_ids
        return next_token(ids[-1], len(ids), seq.params.stop_token_ids), None


class SimWorker(WorkerRef):
    """One simulated worker: the router's view (:class:`WorkerRef`) and its engine."""

    def __init__(self, name: str, role: str, config: EngineConfig, profile: Profile,
                 node: int = 0) -> None:
        """``profile``: at the worker's degree (:meth:`Profile.at_tp`); ``node``: where its
        GPUs are (:func:`place_on_nodes`)."""
        super().__init__(name, role)
        self.is_alive = True
        self.runtime = VirtualRuntime(config, profile)
        self.tp, self.node = profile.tp, node
        # its GPUs' links, each tp wide: across nodes (also the store's) and within its node
        self.nic = NicQueue(profile.link.wide(profile.tp))
        self.node_nic = NicQueue(profile.link_between(True).wide(profile.tp))
        self.is_stepping = False
        self.admit_queue: collections.deque = collections.deque()  # decode: remote admits
        # decode: admitted remote prompts (blocks allocated) before their first token
        self.awaiting_kv: dict[str, Sequence] = {}
        self.seqs: dict[str, Sequence] = {}  # what this worker holds, by request id
        self.busy_s = 0.0
        self.step_end_s = 0.0  # when its current (or last) step ends
        # shared devices (config.sim_devices): the current step's modelled seconds still to
        # run, its share of the devices since ``rate_since``, its tokens, and the token of
        # the end event that stands (earlier ones were rescheduled)
        self.work_left = 0.0
        self.rate = 0.0
        self.rate_since = 0.0
        self.produced: list = []
        self.step_token = 0
        self.pool: PrefillPool | None = None  # with a KV pool: its PrefillPool


@dataclass
class SimRequest:
    """One request on the virtual clock: its arrival, prompt, tokens' times and where it ran."""

    rid: str
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int
    prompt_hashes: list[int] | None = None  # its full blocks' hashes, if given to run()
    token_times: list[float] = field(default_factory=list)
    prefill: SimWorker | None = None
    decode: SimWorker | None = None
    prefilled: tuple | None = None  # after-prefill handoff: (prefill seq, token 0) until sent
    cached_blocks: int = 0  # decode worker's prefix hits (blocks not sent)
    prefill_hit_blocks: int = 0
    mode: str = "local"
    kv_transfer_ms: float | None = None
    done_s: float | None = None


@dataclass
class SimResult:
    """What :func:`simulate` measured: per-request records (loadgen's form) and counters.
    ``twin_end_s``: with a ``twin``, where its rebalancer never moved a worker (then its run
    is this one, ending at ``twin_end_s``), else None. ``stopped``: its ``watch`` ended it
    early; the records are the requests finished by then."""

    records: list[dict]
    counters: dict
    end_s: float
    twin_end_s: float | None = None
    stopped: bool = False



def place_on_nodes(tps: list[int], gpus_per_node: int) -> list[int]:
    """The node of each worker, of TP ``tps[i]`` in order, its GPUs consecutive: a worker
    that does not fit in the rest of a node starts the next (a TP group stays in one
    node where it can)."""
    nodes, gpu = [], 0
    for tp in tps:
        left = gpus_per_node - gpu % gpus_per_node
        if tp > left and tp <= gpus_per_node:
            gpu += left
        nodes.append(gpu // gpus_per_node)
        gpu += tp
    return nodes

