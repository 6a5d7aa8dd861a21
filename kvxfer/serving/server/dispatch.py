"""Per-request orchestration in the router: pick workers, relay events, fail fast.

Disaggregated flow for one request ``rid``::

    router --admit(remote)--> decode      decode reserves blocks (k prefix-cached)
    router <--admitted(k)---- decode      and posts agent.recv(blocks[k:])
    router --prefill(dst,k)-> prefill     prefill computes, samples token 0,
    router <--token---------- prefill     (streamed to the client at once)
    router --first_token----> decode
                              prefill --agent.send(blocks[k:])--> decode
    router <--sent/send_failed prefill    (transfer_failed relayed to decode)
    router <--kv, token..., done-- decode

Colocated: ``admit(local)`` to one worker, which prefills and decodes itself.
Conditional disaggregation (``--local-prefill-tokens``, ``--local-prefill-queue``):
a request arriving while the prefill worker holds that many requests is sent
``admit(local)`` to its decode worker; a request whose uncached prompt (after the
decode worker's prefix-cache hits) is shorter than the token threshold is
answered ``admitted(local)`` and prefilled there; no KV moves for either.
Routing (``--routing``, :mod:`kvxfer.serving.server.routing`): each pick sees the
prompt, so a ``kv`` policy can send it where its prefix is cached: the colocated
worker, or in disaggregated mode both the prefill worker (its cache spares
compute) and the decode worker (its cache spares transfer: it caches the
blocks it receives, and its hits are not sent). The workers' ``kv_events``
keep the policy's prefix index current; a dead worker's entries are dropped.
Every request ends with exactly one terminal event on its queue: ``done`` or
``error``; a worker death produces ``error`` for what it held, never a hang.

Retries (``--retries N``): a request whose worker dies (or answers ``error``
with kind ``worker_error``/``shutting_down``) before any token was streamed is
placed again on live workers, up to N times, under a new wire id
(``<rid>~<attempt>``: the agents never see an id twice); what the old attempt
left on the surviving worker is aborted. Once a token went out, the stream
ends with an error event instead (the client already holds part of an answer).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable

from ...errors import KVXferError
from .launcher import Cluster, WorkerProcess
from .prom import FAST_BUCKETS, LATENCY_BUCKETS, Registry
from .request_state import RequestState
from .serve_config import ServeConfig

log = logging.getLogger("kvxfer.serve")


class NoWorkerAvailable(KVXferError):
    """No live worker of a needed role (the router answers 503)."""


RETRYABLE_KINDS = ("worker_error", "shutting_down")


def prefill_queue_full(prefill_load: int, config: ServeConfig) -> bool:
    """Conditional disaggregation's router rule: whether a request arriving while the chosen
    prefill worker holds ``prefill_load`` requests is prefilled on its decode worker instead
    (``config.local_prefill_queue``; 0: never). Pure: the virtual clock calls it too."""
    limit = config.local_prefill_queue
    return bool(limit) and prefill_load >= limit


def usable(worker, role: str) -> bool:
    """Whether ``worker`` can take a request's ``role`` part now: alive, of that role (a
    worker moved by the rebalancer since it was picked is not) and not being moved. Pure:
    the virtual clock calls it too."""
    return (worker is not None and worker.is_alive and worker.role == role
            and not worker.is_switching)


class Dispatcher:
    def __init__(self, config: ServeConfig, registry: Registry):
        self.config = config
        if config.discovery:
            from .remote import RemoteCluster

            self.cluster = RemoteCluster(config, self.on_message, self.on_worker_exit)
        else:
            self.cluster = Cluster(config, self.on_message, self.on_worker_exit)
        self.requests: dict[str, RequestState] = {}  # by wire id (current attempt)
        self._by_public: dict[str, RequestState] = {}
        self.on_role_changed: Callable[[object, dict], None] | None = None  # rebalancer
        self.on_record: list[Callable[[RequestState], None]] = []  # finished requests
        self._stats_waiters: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        r = registry
        self.m_ttft = r.histogram("kvxfer_ttft_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.m_tpot = r.histogram("kvxfer_tpot_seconds", "Mean time per output token after the first.", FAST_BUCKETS)
        self.m_e2e = r.histogram("kvxfer_e2e_latency_seconds", "Request latency, arrival to last token.", LATENCY_BUCKETS)
        self.m_kv_time = r.histogram("kvxfer_kv_transfer_seconds", "KV transfer time per request (send posted to data visible at the decode worker).", FAST_BUCKETS)
        self.m_kv_bytes = r.counter("kvxfer_kv_transfer_bytes_total", "KV bytes moved prefill -> decode.")
        self.m_kv_failures = r.counter("kvxfer_kv_transfer_failures_total", "KV transfers that failed.")
        self.m_recomputes = r.counter("kvxfer_kv_recomputes_total", "Prompts recomputed on the decode worker after a failed transfer.")
        self.m_requests = r.counter("kvxfer_requests_total", "Finished requests (one per choice) by outcome: ok, error, aborted (the client went away), timeout.", ("outcome",))
        self.m_tokens = r.counter("kvxfer_generated_tokens_total", "Generated tokens.")
        self.m_local_prefills = r.counter("kvxfer_local_prefills_total", "Disaggregated requests prefilled on their decode worker, by reason.", ("reason",))
        self.m_routed_blocks = r.counter("kvxfer_routed_blocks_total", "Full prompt blocks routed (kind=prompt), those the picked worker's prefix cache held by the router's index (kind=hit) and those the KV pool held (kind=pool, --store with --routing kv), by routing policy and the picked worker's role.", ("policy", "role", "kind"))
        self.m_bad_kv_events = r.counter("kvxfer_bad_kv_events_total", "kv_events messages from workers dropped as malformed.")
        self.m_retries = r.counter("kvxfer_request_retries_total", "Requests placed again after their worker died or failed, by role.", ("role",))

    def new_rid(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() % 10**9:09d}"

    # ---- submission -------------------------------------------------------
    def submit(self, rid: str, prompt_ids: list[int], params: dict, *,
               pool_hit_blocks: int = 0) -> RequestState:
        """Route and admit a request; ``pool_hit_blocks``: leading blocks of its prompt the
        KV pool holds (:mod:`.pool_lookup`), which the prefill pick weighs."""
        st = RequestState(rid, prompt_ids, params)
        self._place(st, pool_hit_blocks)
        self._by_public[rid] = st
        return st

    def _place(self, st: RequestState, pool_hit_blocks: int = 0) -> None:
        """Pick workers for ``st`` and admit it; raises NoWorkerAvailable."""
        rid, prompt_ids, params = st.rid, st.prompt_ids, st.params
        max_tokens = int(params.get("max_tokens") or 0)
        if self.config.is_disaggregated:
            decode = self._pick("decode", prompt_ids, rid, max_tokens, prefills=False)
            prefill = self._pick("prefill", prompt_ids, rid, 0, pool_hit_blocks=pool_hit_blocks)
            if decode is None or prefill is None:
                self.cluster.routing.release(rid)
                raise NoWorkerAvailable("no live prefill or decode worker")
            if prefill_queue_full(prefill.load, self.config):  # conditional disaggregation
                self.cluster.routing.release(rid, prefill.name)
                mode = "local"
                self.m_local_prefills.inc(reason="prefill_queue")
                st.transfer_settled.set()
            else:
                st.prefill, mode = prefill, "remote"
        else:
            decode, mode = self._pick("colocated", prompt_ids, rid, max_tokens), "local"
            if decode is None:
                raise NoWorkerAvailable("no live colocated worker")
            st.transfer_settled.set()
        st.decode = decode
        self.requests[rid] = st
        decode.inflight.add(rid)
        decode.send({"op": "admit", "rid": rid, "prompt_ids": prompt_ids, "params": params,
                     "mode": mode, "local_below": self.config.local_prefill_tokens})

    def _pick(self, role: str, prompt_ids: list[int], rid: str, max_tokens: int, *,
              prefills: bool = True, pool_hit_blocks: int = 0):
        """The routing policy's worker of ``role`` for ``prompt_ids``, its hit counted and
        request ``rid`` booked on it (the policy's ledger: released in :meth:`_release`,
        :meth:`_finish`, :meth:`_retry`, on ``sent``/``send_failed`` for a prefill worker;
        its prefill part on the first token)."""
        route = self.cluster.route(role, prompt_ids, request_id=rid, max_tokens=max_tokens,
                                   prefills=prefills, pool_hit_blocks=pool_hit_blocks)
        if route.worker is not None and route.prompt_blocks:
            policy = self.cluster.routing.name
            self.m_routed_blocks.inc(route.prompt_blocks, policy=policy, role=role, kind="prompt")
            self.m_routed_blocks.inc(route.hit_blocks, policy=policy, role=role, kind="hit")
            if pool_hit_blocks:
                self.m_routed_blocks.inc(pool_hit_blocks, policy=policy, role=role, kind="pool")
        return route.worker

    def abort(self, rid: str, outcome: str = "aborted") -> None:
        """Release the workers' share of a live request and count it under ``outcome``
        (``aborted``: the client went away; ``ok``: a stop string matched; ``timeout``:
        no answer in time). A request that already ended is left as it was counted."""
        st = self._by_public.get(rid)
        if st is not None and not st.is_finished and self.requests.get(st.rid) is st:
            self._release(st)
            self.m_requests.inc(outcome=outcome)

    def _release(self, st: RequestState) -> None:
        if self.requests.get(st.rid) is not st:
            return
        rid = st.rid
        del self.requests[rid]
        self._by_public.pop(st.public_rid, None)
        self.cluster.routing.release(rid)
        st.is_finished = True
        st.transfer_settled.set()
        for worker in (st.prefill, st.decode):
            if worker is not None and rid in worker.inflight:
                worker.inflight.discard(rid)
                if worker.is_alive:
                    worker.send({"op": "abort", "rid": rid})

    # ---- worker events ----------------------------------------------------
    def on_message(self, worker: WorkerProcess, msg: dict) -> None:
        ev, rid = msg.get("ev"), msg.get("rid")
        if ev == "role_changed" and self.on_role_changed is not None:
            self.on_role_changed(worker, msg)
            return
        if ev == "kv_events":
            self._on_kv_events(worker, msg)
            return
        if ev == "stats":
            waiter = self._stats_waiters.pop(msg.get("qid", ""), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
            return
        st = self.requests.get(rid)
        if st is None:  # late event of an aborted request
            worker.inflight.discard(rid)
            return
        now = time.perf_counter()
        if ev == "admitted":
            st.admitted = True
            st.cached_blocks = int(msg.get("cached_blocks", 0))
            if msg.get("local"):  # short uncached prompt: the decode worker prefills it
                if st.prefill is not None:
                    self.cluster.routing.release(rid, st.prefill.name)
                st.prefill = None
                st.transfer_settled.set()
                self.m_local_prefills.inc(reason="short_prompt")
                return
            if not usable(st.prefill, "prefill"):  # died or is switching roles meanwhile
                if st.prefill is not None:
                    self.cluster.routing.release(rid, st.prefill.name)
                st.prefill = self._pick("prefill", st.prompt_ids, rid, 0)
                if st.prefill is None:
                    self._fail(st, "no live prefill worker", "worker_unavailable")
                    return
            st.prefill.inflight.add(rid)
            self._send(st, st.prefill, {"op": "prefill", "rid": rid, "prompt_ids": st.prompt_ids,
                                        "params": st.params, "dst": st.decode.agent_address,
                                        "dst_name": st.decode.name,
                                        "skip_blocks": st.cached_blocks})
        elif ev == "token":
            if not st.token_times:
                self.cluster.routing.prefilled(rid)
            if worker is st.prefill:
                if st.token_times:  # the decode worker recomputed and sampled token 0 first
                    return
                st.first_token = int(msg["token"])
                self._send(st, st.decode, {"op": "first_token", "rid": rid, "token": st.first_token})
            st.token_times.append(now)
            st.events.put_nowait(("token", int(msg["token"]), msg.get("logprobs")))
        elif ev == "sent":  # send posted -> data visible at the decode worker
            worker.inflight.discard(rid)
            self.cluster.routing.release(rid, worker.name)
            st.kv_transfer_ms = float(msg.get("transfer_ms", 0.0))
            self.m_kv_time.observe(st.kv_transfer_ms / 1e3)
            st.transfer_settled.set()
        elif ev == "send_failed":
            worker.inflight.discard(rid)
            self.cluster.routing.release(rid, worker.name)
            self._transfer_failed(st, msg.get("error", "transfer failed"))
        elif ev == "kv":  # the decode side: KV landed (or was recomputed)
            st.recomputed = bool(msg.get("recomputed"))
            if st.recomputed:
                self.m_recomputes.inc()
                st.transfer_settled.set()
                if not st.is_transfer_failed:  # the decode side saw it first (e.g. timeout)
                    st.is_transfer_failed = True
                    self.m_kv_failures.inc()
            else:
                st.kv_bytes = int(msg.get("kv_bytes", 0))
                self.m_kv_bytes.inc(st.kv_bytes)
        elif ev == "done":
            worker.inflight.discard(rid)
            self._finish(st, ("done", msg.get("finish_reason", "stop")))
        elif ev == "error":
            error, kind = f"{worker.name}: {msg.get('error', 'error')}", msg.get("kind", "worker_error")
            if kind in RETRYABLE_KINDS and self._can_retry(st):
                self._retry(st, worker, error)
            else:
                self._fail(st, error, kind)

    def _on_kv_events(self, worker, msg: dict) -> None:
        """A worker's prefix-cache changes into the routing index; a malformed message
        (wrong types, too many hashes) is dropped alone and counted."""
        try:
            self.cluster.routing.on_kv_event(worker.name, msg.get("stored", []),
                                             msg.get("removed", []))
        except (TypeError, ValueError) as exc:
            self.m_bad_kv_events.inc()
            log.warning("kv_events from %s dropped: %s", worker.name, exc)

    def _send(self, st: RequestState, worker: WorkerProcess, msg: dict) -> None:
        try:
            worker.send(msg)
        except ConnectionError as exc:
            self._fail(st, str(exc), "worker_unavailable")

    def _transfer_failed(self, st: RequestState, error: str) -> None:
        if not st.is_transfer_failed:
            st.is_transfer_failed = True
            self.m_kv_failures.inc()
        st.transfer_settled.set()
        log.warning("KV transfer of %s failed: %s", st.rid, error)
        self._send(st, st.decode, {"op": "transfer_failed", "rid": st.rid, "error": error})

    def on_worker_exit(self, worker: WorkerProcess) -> None:
        self.cluster.routing.forget(worker.name)  # a restarted worker starts with an empty cache
        for rid in list(worker.inflight):
            worker.inflight.discard(rid)
            st = self.requests.get(rid)
            if st is None:
                continue
            if self._can_retry(st):
                self._retry(st, worker, f"worker {worker.name} died (exit code {worker.exit_code})")
                continue
            # A prefill worker that died after token 0 only lost the transfer;
            # the decode worker's policy decides (recompute or fail).
            if (worker is st.prefill and st.first_token is not None
                    and st.decode is not None and st.decode.is_alive):
                self._transfer_failed(st, f"prefill worker {worker.name} died")
            else:
                self._fail(st, f"worker {worker.name} died (exit code {worker.exit_code})",
                           "worker_died")

    # ---- retries ----------------------------------------------------------
    def _can_retry(self, st: RequestState) -> bool:
        return not st.is_finished and not st.token_times and st.attempts < self.config.retries

    def _retry(self, st: RequestState, worker, error: str) -> None:
        """Place ``st`` again (module docstring); the failed attempt's share is aborted."""
        old = st.rid
        del self.requests[old]
        self.cluster.routing.release(old)
        for w in (st.prefill, st.decode):
            if w is not None and old in w.inflight:
                w.inflight.discard(old)
                try:
                    w.send({"op": "abort", "rid": old})
                except ConnectionError:  # that worker is gone too: nothing left to abort
                    pass
        st.attempts += 1
        st.rid = f"{st.public_rid}~{st.attempts}"
        st.prefill = st.decode = st.first_token = None
        st.cached_blocks, st.is_transfer_failed, st.admitted = 0, False, False
        st.transfer_settled.clear()
        self.requests[st.rid] = st
        self.m_retries.inc(role=worker.role)
        log.warning("%s: %s; retry %d/%d", st.public_rid, error, st.attempts, self.config.retries)
        try:
            self._place(st)
        except NoWorkerAvailable as exc:
            self._fail(st, f"{error}; retry: {exc}", "worker_unavailable")

    # ---- completion -------------------------------------------------------
    def _fail(self, st: RequestState, error: str, kind: str) -> None:
        if st.is_finished:
            return
        self._release(st)
        self.m_requests.inc(outcome="error")
        st.events.put_nowait(("error", error, kind))

    def _finish(self, st: RequestState, event: tuple) -> None:
        if st.is_finished:
            return
        st.is_finished = True
        self.requests.pop(st.rid, None)
        self._by_public.pop(st.public_rid, None)
        self.cluster.routing.release(st.rid)
        if st.prefill is not None:
            st.prefill.inflight.discard(st.rid)
        self.m_requests.inc(outcome="ok")
        st.events.put_nowait(event)

    def record(self, st: RequestState, num_tokens: int) -> None:
        """Latency metrics of a completed request (called by the router once it replied)."""
        if not st.token_times:
            return
        self.m_ttft.observe(st.ttft_s)
        self.m_e2e.observe(st.token_times[-1] - st.t_arrival)
        self.m_tokens.inc(num_tokens)
        if len(st.token_times) > 1:
            self.m_tpot.observe((st.token_times[-1] - st.token_times[0]) / (len(st.token_times) - 1))
        for hook in self.on_record:
            hook(st)

    async def collect_stats(self, timeout: float = 2.0, workers: list | None = None) -> dict[str, dict]:
        """Each live worker's counters (agent metrics, queue depths), by worker name."""
        loop = asyncio.get_running_loop()
        waiters: dict[str, tuple[str, asyncio.Future]] = {}
        for w in self.cluster.workers if workers is None else workers:
            if not w.is_alive:
                continue
            qid = self.new_rid("stats")
            future = self._stats_waiters[qid] = loop.create_future()
            try:
                w.send({"op": "stats", "qid": qid})
            except ConnectionError:
                del self._stats_waiters[qid]
                continue
            waiters[w.name] = (qid, future)
        if waiters:  # a busy worker answers between steps; a dead one never does
            await asyncio.wait([f for _, f in waiters.values()], timeout=timeout)
        out = {}
        for name, (qid, future) in waiters.items():
            self._stats_waiters.pop(qid, None)
            if future.done():
                out[name] = future.result()
        return out
