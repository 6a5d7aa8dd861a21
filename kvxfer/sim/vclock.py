"""The virtual clock: a cluster of simulated workers in one discrete-event loop, no processes.

:func:`simulate` replays trace requests on the cluster a :class:`ServeConfig` describes
and returns per-request records in ``kvxfer loadgen``'s form (``sent_s``, ``ttft_s``,
``e2e_s``, ``output_tokens``, ``ok``, ``tpot_s``), which :func:`kvxfer.loadgen.metrics.summarize_run`
scores. What runs is the serving code itself, each worker with its own:

- :class:`~kvxfer.serving.engine.runtime.Runtime` step (the real :class:`Scheduler` and
  :class:`BlockManager`, prefix cache, chunked prefill, preemption), its forward pass
  replaced by the profile's modelled step time (:class:`VirtualRuntime`);
- a device of its own, or with ``config.sim_devices`` K (``kvxfer serve --sim-devices``)
  a share of K devices common to all workers: while B workers are in a step, each
  step advances at ``min(1, K/B)`` of its modelled speed (:mod:`kvxfer.serving.simulated.devices`;
  every step's end is recomputed when a step starts or ends);
- its tensor-parallel degree (``ServeConfig.tp_degrees``, the configuration's ``@K``
  suffix): the profile's fit at that degree (:meth:`~kvxfer.serving.simulated.profile.Profile.at_tp`)
  and, unless ``config.num_blocks`` is set, its KV capacity as the pool;
- the P->D handoff (:mod:`kvxfer.sim.handoff`): the profile's links, ``tp`` GPUs wide,
  NVLink within a node and the network across (workers' GPUs laid out on nodes in
  order, :func:`~kvxfer.sim.virtual_worker.place_on_nodes`), in kvxfer's order (the
  decode worker reserves the prompt's blocks first) or DistServe's (it takes the KV
  once prefilled, when it has the blocks);
- with a KV pool (``store``, as ``kvxfer serve --store``): the workers' own
  :class:`~kvxfer.serving.workers.pool.PrefillPool` over :mod:`kvxfer.sim.store` (the
  store nodes' real index and placement): a prompt admitted on a prefill worker loads
  its pool hits first (the worker waits for the get), and its computed blocks are put
  after its prefill (the blocks freed once both the send and the put ended). Colocated
  workers have no pool, as in ``kvxfer serve``. With ``kv`` routing the router looks
  each prompt up in the pool (:func:`~kvxfer.serving.server.pool_lookup.lookup_keys`)
  and the prefill pick weighs its blocks, as the router does;

and for the router: the routing policy (:mod:`kvxfer.serving.server.routing`, ``least-loaded``
or ``kv``) fed each worker's prefix-cache events after every step, as the workers publish
them (:meth:`BlockManager.drain_events`; not with ``least-loaded``, whose pick does not
read them: they would only count its hits), the conditional
disaggregation rule (:func:`~kvxfer.serving.server.dispatch.prefill_queue_full`; the decode
worker's uncached-prompt rule as in :mod:`kvxfer.serving.workers.decode`), and the
rebalancer's policy (:func:`~kvxfer.serving.server.adaptive_policy.decide`) observed every
``policy.interval_s`` of virtual time, a moved worker drained first as the rebalancer does.

A ``watch`` (:class:`kvxfer.sim.plan.SLOWatch`) may stop a run early: ``watch(request,
done)`` at each request's first token and end, ``watch.due(request, first)`` the time by
which its first token (at arrival) or its end (at its first token) must have come, and
``watch.late(request, "ttft" | "tpot")`` when it has not; a True from either stops the run
(``kvxfer plan`` stops one once too many requests missed the SLO to reach its attainment). Times are virtual seconds from the first arrival. A step changes the scheduler's state
when it starts and delivers its tokens when it ends. Not modelled: HTTP, IPC and
tokenization times (the wall-clock engine has them; the validation measures the gap),
the router's per-message costs, the time a role switch takes.
"""
from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass, replace

from ..serving.channel.ipc import kv_event_batches
from ..serving.engine.block_manager import HashChain
from ..serving.engine.config import EngineConfig
from ..serving.engine.runtime import finish_reason
from ..serving.engine.sampling import SamplingParams
from ..serving.engine.sequence import Sequence
from ..serving.server.adaptive_policy import Observation, PolicyState, attainment, changed, decide
from ..serving.server.dispatch import prefill_queue_full
from ..serving.server.rebalancer import SLO_WINDOW
from ..serving.server.serve_config import ServeConfig
from ..serving.server.routing import make_policy
from ..serving.server.pool_lookup import lookup_keys
from ..serving.workers.pool import PrefillPool
from ..serving.simulated.profile import Profile
from .handoff import KVHandoff
from .store import StoreSpec, VirtualStore, VirtualStoreClient
from .virtual_worker import SimRequest, SimResult, SimWorker, gc_paused, place_on_nodes


class VirtualCluster(KVHandoff):
    """The event loop over the workers of ``config`` (see the module docstring; the P->D
    handoff is :class:`~kvxfer.sim.handoff.KVHandoff`'s)."""

    def __init__(self, config: ServeConfig, profile: Profile, *, routing: str = "least-loaded",
                 twin: ServeConfig | None = None, routed_hits: bool = True,
                 store: StoreSpec | None = None, watch=None, **routing_knobs) -> None:
        if twin is not None and (config.adaptive is not None or twin.adaptive is None
                                 or replace(twin, adaptive=None, adaptive_slo_ms=None) != config):
            raise ValueError("twin: the adaptive configuration of this static split")
        self.config = config
        # the rebalancer's policy, moving workers (adaptive) or only watched (a twin's)
        self.adaptive, self.adaptive_slo_ms = (twin or config).adaptive, (twin or config).adaptive_slo_ms
        self.is_twin_watch = twin is not None
        self.twin_moved = False
        self.profile = profile
        self.routing = make_policy(routing, profile.block_size, **routing_knobs)
        self.handoff_after_prefill = profile.engine["handoff"] == "after-prefill"
        if self.handoff_after_prefill and (config.adaptive or twin or config.local_prefill_tokens
                                           or config.local_prefill_queue):
            raise ValueError(f"profile {profile.name!r} hands KV over after prefill "
                             f"({profile.engine['name']}): conditional and adaptive "
                             f"configurations are not modelled with it")
        engine = EngineConfig(num_blocks=config.num_blocks or EngineConfig.num_blocks,
                              block_size=profile.block_size, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              schedule=config.schedule,
                              preemption=profile.engine["preemption"])
        specs = config.worker_specs()
        nodes = place_on_nodes([s.tp for s in specs], profile.gpus_per_node)
        self.workers = []
        for spec, node in zip(specs, nodes):
            at_tp = profile.at_tp(spec.tp)  # ProfileError naming the degrees it has
            blocks = config.num_blocks or at_tp.default_num_blocks(EngineConfig.num_blocks)
            self.workers.append(SimWorker(spec.name, spec.role, replace(engine, num_blocks=blocks),
                                          at_tp, node))
        self.watch = watch  # watch(request, done) at its first token and end; True: stop
        self.stopped = False
        self.num_devices = config.sim_devices  # None: a device per worker
        self._on_device: list[SimWorker] = []  # shared devices: the workers in a step
        # the cache events feed the router's prefix index; a policy that does not pick by
        # it (least-loaded) needs them only to count its hits (``routed_hits``)
        self.publishes_events = self.routing.chooses_by_prefix or routed_hits
        for w in self.workers:
            if self.publishes_events:
                w.runtime.blocks.record_events()
            self.routing.set_capacity(w.name, w.runtime.blocks.num_blocks)
        self.store = None if store is None else VirtualStore(store, profile, self._clock)
        # the router weighs the pool's blocks where it has a pool and picks by prefix
        self.router_looks_up = (self.store is not None and self.routing.chooses_by_prefix
                                and config.is_disaggregated)
        self.pool_salt = f"kvxfer-vclock|{profile.name}|{profile.block_bytes}".encode()
        if self.store is not None:  # every worker that can be a prefill worker, as the workers' --store
            salt = self.pool_salt
            for w in self.workers:
                if w.role != "colocated":
                    client = VirtualStoreClient(self.store, w.nic, self._step_end_of(w), self.at,
                                                self._puts_done_of(w))
                    w.pool = PrefillPool(client, w.runtime, salt)
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        self.requests: dict[str, SimRequest] = {}  # unfinished
        self.num_waiting = 0  # of them, those without their first token
        self.finished: list[SimRequest] = []
        self.rejected: list[SimRequest] = []  # longer than a worker's pool, as the router refuses
        # a request must fit every worker's pool (the router's check, against the smallest)
        self.pool_tokens = min(w.runtime.blocks.num_blocks for w in self.workers) * engine.block_size
        self.counters = collections.Counter()
        self.num_steps = 0  # counted apart from ``counters``: one a step
        self.recent: collections.deque = collections.deque(maxlen=SLO_WINDOW)
        self.policy_state = PolicyState()
        self._switching: SimWorker | None = None
        self._switch_to: tuple[str, float] | None = None  # (role, abandon at)

    # ---- the loop -----------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def _clock(self) -> float:
        return self.now

    @staticmethod
    def _step_end_of(worker: SimWorker):
        return lambda: worker.step_end_s

    def _puts_done_of(self, worker: SimWorker):
        return lambda: self._puts_done(worker)

    def run(self, arrivals: list[tuple[float, list[int], int]],
            prompt_hashes: list[list[int]] | None = None) -> SimResult:
        """Replay ``(arrival_s, prompt_ids, max_tokens)`` requests to completion.
        ``prompt_hashes``: :func:`prompt_hashes` of ``arrivals`` (computed as needed if None)."""
        if prompt_hashes is not None and len(prompt_hashes) != len(arrivals):
            raise ValueError(f"{len(prompt_hashes)} prompt hash lists for {len(arrivals)} requests")
        size = self.profile.block_size
        requests = []
        for i, (t, ids, max_tokens) in enumerate(arrivals):
            hashes = None
            if prompt_hashes is not None:
                hashes = prompt_hashes[i]
                if len(hashes) != len(ids) // size:
                    raise ValueError(f"request {i}: {len(hashes)} prompt hashes for "
                                     f"{len(ids) // size} full blocks")
            elif set(map(type, ids)) != {int}:  # checked once: its sequences skip the check
                ids = list(map(int, ids))
            requests.append(SimRequest(f"r{i}", t, ids, max_tokens, hashes))
        # arrival i is event (t, i), as if all were queued first, but enters the queue only
        # when the one before it in that order leaves: the same events, a short queue
        self._incoming = requests
        self._arrivals = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)  # stable
        self._next_arrival = 0
        self._order = itertools.count(len(requests))
        self._queue_arrival()
        observe = self._observe_event = self._observe  # one object: known by identity
        late = self._late_event = self._late
        if self.adaptive is not None and arrivals:
            self.at(self.adaptive.interval_s, observe)
        self._num_left = len(arrivals)
        events, last_work_s = self._events, 0.0
        try:
            with gc_paused():
                while events and not self.stopped:
                    self.now, _, fn, args = heapq.heappop(events)
                    fn(*args)
                    if fn is not observe and fn is not late:
                        last_work_s = self.now
        finally:
            del self._observe_event, self._late_event  # bound methods of self: no cycles left
        if self.stopped:  # the watch's call: what finished so far, the rest left running
            return SimResult([self._record(r) for r in self.finished], dict(self.counters),
                             self.now, stopped=True)
        stuck = [w.name for w in self.workers if w.runtime.scheduler.has_work() or w.admit_queue
                 or (w.pool is not None and w.pool.queue)]
        if self._num_left or stuck:
            raise RuntimeError(f"virtual clock ended with {self._num_left} requests unfinished "
                               f"(workers with work: {stuck}): nothing left could move them, "
                               f"e.g. a request that cannot fit a KV pool of "
                               f"{self.pool_tokens // self.profile.block_size} blocks")
        if self.num_steps:
            self.counters["steps"] += self.num_steps
        for w in self.workers:  # the prefix cache's effect, as each worker's BlockManager counts it
            self.counters["query_tokens"] += w.runtime.blocks.num_query_tokens
            self.counters["hit_tokens"] += w.runtime.blocks.num_hit_tokens
            self.counters["preemptions"] += w.runtime.scheduler.num_preemptions
            if w.pool is not None:  # the pool's, as the workers report them
                self.counters.update(w.pool.counters)
        if self.store is not None:
            stats = self.store.stats()
            for k in ("evictions", "objects", "hits", "misses"):
                self.counters[f"store_node_{k}"] = stats[k]
        # the router's view, once a pick: the index's hit on the chosen worker (a preempted
        # request allocating again counts again in hit_tokens, never here); only where the
        # index was fed
        if self.publishes_events:
            self.counters["routed_hit_blocks"] = self.routing.stats["hit_blocks"]
            self.counters["routed_prompt_blocks"] = self.routing.stats["prompt_blocks"]
        records = [self._record(r) for r in self.finished]
        records += [{"ok": False, "sent_s": r.arrival_s, "input_tokens": len(r.prompt_ids),
                     "error": f"prompt + max_tokens exceeds a worker's KV pool "
                              f"({self.pool_tokens} tokens)"} for r in self.rejected]
        if self.is_twin_watch:  # this run ends with its last request; the twin's observes on
            return SimResult(records, dict(self.counters), last_work_s,
                             None if self.twin_moved else self.now)
        return SimResult(records, dict(self.counters), self.now)

    def _record(self, r: SimRequest) -> dict:
        return {"ok": True, "sent_s": r.arrival_s, "ttft_s": r.token_times[0] - r.arrival_s,
                "e2e_s": r.token_times[-1] - r.arrival_s, "output_tokens": len(r.token_times),
                "tpot_s": ((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                           if len(r.token_times) > 1 else None),
                "input_tokens": len(r.prompt_ids), "mode": r.mode,
                "cached_blocks": r.cached_blocks, "prefill_hit_blocks": r.prefill_hit_blocks,
                "kv_transfer_ms": r.kv_transfer_ms,
                "decode": r.decode.name, "prefill": r.prefill.name if r.prefill else None}

    # ---- the router ---------------------------------------------------------------
    def role(self, role: str) -> list[SimWorker]:
        return [w for w in self.workers if w.role == role]

    def _pick(self, role: str, r: SimRequest, pool_hit_blocks: int = 0) -> SimWorker | None:
        """The routing policy's pick among the workers of ``role`` taking requests (as
        :meth:`kvxfer.serving.server.launcher.Cluster.route`), ``r`` booked on it as the
        dispatcher books it."""
        live = [w for w in self.role(role) if not w.is_switching]
        if not live:
            return None
        return self.routing.pick(live, r.prompt_ids, request_id=r.rid,
                                 max_tokens=0 if role == "prefill" else r.max_tokens,
                                 prefills=role != "decode", pool_hit_blocks=pool_hit_blocks)

    def _publish(self, worker: SimWorker) -> None:
        """``worker``'s prefix-cache changes to the router's policy (its kv_events)."""
        if not self.publishes_events:
            return
        stored, removed = worker.runtime.blocks.drain_events()
        for part_stored, part_removed in kv_event_batches(stored, removed):  # as workers send
            self.routing.on_kv_event(worker.name, part_stored, part_removed)

    def _sequence(self, r: SimRequest, params: SamplingParams) -> Sequence:
        """A sequence of ``r``'s prompt; its chain starts from the prompt's known hashes."""
        seq = Sequence(r.prompt_ids, params, r.rid, ints_checked=True)
        if r.prompt_hashes is not None:
            seq.hash_chain = HashChain(self.profile.block_size, r.prompt_hashes)
        return seq

    def _queue_arrival(self) -> None:
        if self._next_arrival < len(self._arrivals):
            i = self._arrivals[self._next_arrival]
            self._next_arrival += 1
            r = self._incoming[i]
            heapq.heappush(self._events, (r.arrival_s, i, self._arrive, (r,)))

    def _arrive(self, r: SimRequest) -> None:
        self._queue_arrival()
        if len(r.prompt_ids) + r.max_tokens > self.pool_tokens:  # the router's HTTP 400
            self.counters["rejected_too_long"] += 1
            self.rejected.append(r)
            self._num_left -= 1
            self._watched(r, True)
            return
        self.requests[r.rid] = r
        self.num_waiting += 1
        if self.watch is not None:  # when its TTFT is missed for certain, if not there by then
            self.at(self.watch.due(r, False), self._late_event, r, False)
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        if not self.config.is_disaggregated:
            r.decode = self._pick("colocated", r)
            self._admit_local(r, params)
            return
        if self.handoff_after_prefill:  # DistServe: the decode instance is picked once prefilled
            r.prefill, r.mode = self._pick("prefill", r), "remote"
            self._submit_prefill(r.prefill, r, self._sequence(r, params))
            return
        r.decode = self._pick("decode", r)
        pool_hit_blocks = 0
        if self.router_looks_up:  # the router's pool lookup, before its picks (dispatcher.submit)
            pool_hit_blocks = self.store.lookup(lookup_keys(r.prompt_ids, self.profile.block_size,
                                                            self.pool_salt))
            self.counters["routed_pool_blocks"] += pool_hit_blocks
        prefill = self._pick("prefill", r, pool_hit_blocks)
        if prefill_queue_full(prefill.load, self.config):
            self.counters["local_prefill_queue"] += 1
            self.routing.release(r.rid, prefill.name)
            self._admit_local(r, params)
            return
        r.prefill, r.mode = prefill, "remote"
        r.decode.inflight.add(r.rid)
        seq = r.decode.seqs[r.rid] = self._sequence(r, params)
        r.decode.admit_queue.append(seq)
        self._try_admit_remote(r.decode)

    def _admit_local(self, r: SimRequest, params: SamplingParams) -> None:
        worker = r.decode
        worker.inflight.add(r.rid)
        seq = worker.seqs[r.rid] = self._sequence(r, params)
        worker.runtime.scheduler.add(seq)
        self._kick(worker)

    # ---- workers ------------------------------------------------------------------
    def _kick(self, worker: SimWorker) -> None:
        """Start ``worker``'s next step if it is idle and has one."""
        runtime = worker.runtime
        if worker.is_stepping:
            return
        if worker.pool is not None:  # as PrefillWorker.tick, before its step
            worker.pool.admit_queued()
        if not runtime.scheduler.has_work():
            return
        step = runtime.step()
        self._publish(worker)
        if not step.num_tokens:  # nothing fits the free blocks: a finish or free kicks again
            return
        worker.is_stepping = True
        worker.busy_s += runtime.last_step_s
        self.num_steps += 1
        # a pool get the worker waits for delays the step (it ran before it, in its loop)
        start = self.now if worker.pool is None else max(self.now, worker.pool.store.ready_at)
        if self.num_devices is None:
            worker.step_end_s = start + runtime.last_step_s
            self.at(worker.step_end_s, self._step_done, worker, step.produced)
            return
        worker.work_left, worker.produced = runtime.last_step_s, step.produced
        worker.step_end_s = start + runtime.last_step_s  # until it shares the devices
        if start > self.now:
            self.at(start, self._join_devices, worker)
        else:
            self._join_devices(worker)

    # ---- shared devices (config.sim_devices) ----------------------------------------
    def _join_devices(self, worker: SimWorker) -> None:
        worker.rate, worker.rate_since = 0.0, self.now
        self._on_device.append(worker)
        self._reshare()

    def _reshare(self) -> None:
        """Every step on the devices: its work done at its old share, its end at the new."""
        on = self._on_device
        if not on:
            return
        rate = min(1.0, self.num_devices / len(on))
        for w in on:
            if w.rate == rate:  # its share and so its end stand
                continue
            w.work_left = max(0.0, w.work_left - (self.now - w.rate_since) * w.rate)
            w.rate, w.rate_since = rate, self.now
            w.step_end_s = self.now + w.work_left / rate
            w.step_token += 1
            self.at(w.step_end_s, self._device_step_done, w, w.step_token)

    def _device_step_done(self, worker: SimWorker, token: int) -> None:
        if token != worker.step_token:  # rescheduled since
            return
        self._on_device.remove(worker)
        self._reshare()
        produced, worker.produced = worker.produced, []
        self._step_done(worker, produced)

    def _step_done(self, worker: SimWorker, produced) -> None:
        worker.is_stepping = False
        for seq, token in produced:
            r = self.requests[seq.request_id]
            if worker.role == "prefill":
                self._prefilled(worker, r, seq, token)
                continue
            if not r.token_times:
                self.num_waiting -= 1
                if r.mode == "local":  # its prefix hits on this worker
                    r.cached_blocks = seq.num_cached_tokens // worker.runtime.block_size
                    self.routing.prefilled(r.rid)
            seq.token_ids.append(token)
            r.token_times.append(self.now)
            if len(r.token_times) == 1:
                self._watched(r, False)
            reason = finish_reason(seq, token)
            if reason is not None:
                worker.runtime.scheduler.finish(seq, reason)
                self._done(worker, r)
        self._kick(worker)
        if worker.admit_queue:
            self._try_admit_remote(worker)

    def _done(self, worker: SimWorker, r: SimRequest) -> None:
        del self.requests[r.rid]
        del worker.seqs[r.rid]
        worker.inflight.discard(r.rid)
        self.routing.release(r.rid)
        r.done_s = self.now
        self.finished.append(r)
        self._num_left -= 1
        times = r.token_times
        self.recent.append((times[0] - r.arrival_s,
                            (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0))
        self._watched(r, True)
        self._maybe_switch(worker)

    def _watched(self, r: SimRequest, done: bool) -> None:
        """``r`` got its first token (``done`` False) or ended: the watch may stop the run."""
        watch = self.watch
        if watch is None or self.stopped:
            return
        if watch(r, done):
            self.stopped = True
            self._events.clear()
        elif not done and r.token_times:  # when its TPOT is missed for certain, if not done by then
            due = watch.due(r, True)
            if due is not None:
                self.at(due, self._late_event, r, True)

    def _late(self, r: SimRequest, first: bool) -> None:
        """A watched deadline of ``r``: its first token (``first`` False) or its end not
        there yet is a miss the watch counts now."""
        if self.stopped or (r.done_s is not None if first else bool(r.token_times)):
            return
        if self.watch.late(r, "tpot" if first else "ttft"):
            self.stopped = True
            self._events.clear()

    # ---- the rebalancer -----------------------------------------------------------
    def _observe(self) -> None:
        """The rebalancer's look every ``interval_s``. Watching for a twin it moves nothing:
        it stops at the first move the twin would make (from there on the runs differ)."""
        if self.twin_moved:
            return
        policy = self.adaptive
        # the next look, while requests are left and anything else can still happen (a
        # look starts nothing: with no other event the run is stuck, and ends to say so)
        if self._num_left and self._events:
            self.at(self.now + policy.interval_s, self._observe_event)
        if self._switching is not None:  # one move at a time, as the rebalancer awaits it
            if self.now >= self._switch_to[1]:  # drain took too long: it stays
                self._switching.is_switching = False
                self._switching = None
            return
        prefill = [w for w in self.role("prefill") if not w.is_switching]
        decode = [w for w in self.role("decode") if not w.is_switching]
        blocked = sum(len(w.admit_queue) for w in self.role("decode"))  # no decode blocks yet
        total = sum(w.runtime.blocks.num_blocks for w in decode)
        free = sum(w.runtime.blocks.num_free_blocks for w in decode)
        reserved = self._reserved_blocks(decode)
        ttft_att, tpot_att = attainment(self.recent, self.adaptive_slo_ms)
        obs = Observation(self.now, len(prefill), len(decode), self.num_waiting - blocked,
                          len(self.requests) - self.num_waiting,
                          kv_use=(total - free) / total if total else 0.0, admit_queue=blocked,
                          kv_reserved=reserved / total if total else 0.0,
                          ttft_attainment=ttft_att, tpot_attainment=tpot_att)
        move, self.policy_state = decide(obs, self.policy_state, policy)
        if move is None:
            return
        candidates = [w for w in self.role(move.src) if not w.is_switching]
        if len(candidates) < 2:
            return
        if self.is_twin_watch:
            self.twin_moved = True
            return
        worker = min(candidates, key=lambda w: w.load)
        worker.is_switching = True
        self._switching, self._switch_to = worker, (move.dst, self.now + policy.drain_timeout_s)
        self.counters[f"move_{move.src}_to_{move.dst}"] += 1
        self._maybe_switch(worker)

    def _reserved_blocks(self, decode: list[SimWorker]) -> int:
        """The blocks ``decode`` workers hold for prompts without their first token: remote
        ones admitted (``awaiting_kv``), local ones being prefilled there (``running``);
        those still queued (admit queue, the scheduler's waiting) hold none."""
        requests = self.requests
        return sum(sum(len(seq.block_table) for seq in w.awaiting_kv.values())
                   + sum(len(seq.block_table) for seq in w.runtime.scheduler.running
                         if not requests[seq.request_id].token_times)
                   for w in decode)

    def _maybe_switch(self, worker: SimWorker) -> None:
        """A drained worker being moved takes its new role (its pool is all free)."""
        if worker is not self._switching or worker.inflight or worker.seqs:
            return
        worker.role = self._switch_to[0]
        worker.is_switching = False
        self._switching = None
        self.policy_state = changed(self.policy_state, self.now)
        self.counters["role_changes"] += 1


def prompt_hashes(arrivals: list[tuple[float, list[int], int]], block_size: int) -> list[list[int]]:
    """Each request's prompt full-block hashes (:class:`HashChain`), for :func:`simulate`:
    computed once for a trace slice, they serve every configuration run on it (the runs of
    ``kvxfer plan`` inherit them). ``TypeError`` if a prompt holds ids that are not plain
    ``int`` (a run given these hashes does not check its prompts again)."""
    out = []
    for i, (_, ids, _) in enumerate(arrivals):
        if set(map(type, ids)) != {int}:
            raise TypeError(f"request {i}: prompt ids must be plain ints "
                            f"(got {sorted({type(t).__name__ for t in ids})})")
        out.append(HashChain(block_size).upto(ids, len(ids) // block_size))
    return out


def simulate(config: ServeConfig, profile: Profile, arrivals: list[tuple[float, list[int], int]],
             *, routing: str = "least-loaded", prompt_hashes: list[list[int]] | None = None,
             twin: ServeConfig | None = None, routed_hits: bool = True,
             store: StoreSpec | None = None, watch=None, **routing_knobs) -> SimResult:
    """Run ``arrivals`` (``(arrival_s, prompt_ids, max_tokens)``, sorted by time) on the
    cluster ``config`` describes, on the virtual clock, the router's picks by the routing
    policy ``routing`` (:func:`kvxfer.serving.server.routing.make_policy`).
    ``prompt_hashes``: :func:`prompt_hashes` of ``arrivals`` with the profile's block size
    (the same results, less work when several runs share a slice: the prompts were
    checked to be plain ints there). Without them, prompt ids that are not plain ``int``
    are converted.

    ``twin``: the adaptive configuration of the static split ``config`` (``adaptive:xPyD``
    of ``xPyD``). Its rebalancer's policy is consulted as it would be, moving nothing; an
    adaptive run whose rebalancer never moves a worker is the static run itself (the
    policy only reads the cluster), so where the twin never moved, ``twin_end_s`` is set
    and the twin's result is this one ending then (its last look may come after the last
    request). ``ValueError`` if ``twin`` is not ``config`` with a rebalancer.

    ``routed_hits``: count the router's hits (counters ``routed_hit_blocks`` and
    ``routed_prompt_blocks``). A policy that picks by prefix always has them; for
    ``least-loaded`` they cost feeding its index every worker's cache events (about
    1.4x the run's time), so a caller that reads only goodput passes False (the
    records are the same either way).

    ``store``: a KV pool of that many nodes and slots, which the prefill workers use as
    ``kvxfer serve --store``'s do (module docstring); its counters are the workers'
    ``store_*`` and the nodes' ``store_node_*``."""
    with gc_paused():  # its workers' blocks: many objects, no cycles
        cluster = VirtualCluster(config, profile, routing=routing, twin=twin,
                                 routed_hits=routed_hits, store=store, watch=watch, **routing_knobs)
    return cluster.run(arrivals, prompt_hashes)
