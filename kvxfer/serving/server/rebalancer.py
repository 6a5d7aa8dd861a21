"""Dynamic P/D rebalancing in the router (``kvxfer serve --adaptive``).

Every ``policy.interval_s`` the :class:`Rebalancer` observes the cluster and
asks :func:`kvxfer.serving.server.adaptive_policy.decide` whether to move a worker
between the prefill and decode roles. A move is carried out in three steps:

1. **drain**: the least-loaded worker of the source role is marked
   ``is_switching``; the dispatcher gives it no new request (a request already
   admitted elsewhere whose prefill worker is switching gets another one), and
   the rebalancer waits until every request it holds has finished;
2. **switch**: it is sent ``switch_role``; the worker finishes what it still
   owns (sends in flight, recvs whose lease is held), checks that every KV block
   of its pool is free, and starts the other role's loop over the same model,
   pool and agent (``ev: role_changed``);
3. **rejoin**: the router changes its role and it takes requests again.

A drain that outlasts ``policy.drain_timeout_s`` (or a worker that refuses or
dies) is abandoned: the worker rejoins its old role and nothing is counted.

Observed: requests waiting for their first token, split into those waiting for
a decode worker's KV blocks (admit queue: no ``admitted`` event yet) and the rest
(prefill queue), requests past it (decode batch), the decode workers' KV pool
use (their ``stats``) and the part of it admitted prompts without a first token
hold (their prompts' blocks),
and, with ``slo`` set, TTFT/TPOT attainment over the last ``SLO_WINDOW``
finished requests. Each change is logged and counted in
``kvxfer_role_changes_total{from,to,reason}``; ``kvxfer_workers{role}`` (set by
the router) gives the current mix.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

from .adaptive_policy import (AdaptivePolicy, Move, Observation, PolicyState, attainment, changed,
                              decide)

log = logging.getLogger("kvxfer.serve")

SLO_WINDOW = 32  # finished requests the attainment is computed over
STATS_TIMEOUT_S = 1.0


class Rebalancer:
    def __init__(self, dispatcher, registry, policy: AdaptivePolicy,
                 slo_ms: tuple[float, float] | None = None):
        self.dispatcher = dispatcher
        self.cluster = dispatcher.cluster
        self.policy = policy
        self.slo_ms = slo_ms
        self.state = PolicyState()
        self.recent: collections.deque = collections.deque(maxlen=SLO_WINDOW)  # (ttft_s, tpot_s)
        self.num_changes = 0
        self._pending: dict[str, asyncio.Future] = {}  # worker name -> role_changed
        self._reasons: dict[str, str] = {}  # worker name -> reason of the switch asked
        self._task: asyncio.Task | None = None
        self.m_changes = registry.counter(
            "kvxfer_role_changes_total", "Workers moved between prefill and decode, by reason.",
            ("from", "to", "reason"))
        dispatcher.on_role_changed = self._on_role_changed
        dispatcher.on_record.append(self._on_record)

    # ---- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rebalancer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                obs = await self.observe()
                move, self.state = decide(obs, self.state, self.policy)
                if move is not None:
                    await self.execute(move)
            except asyncio.CancelledError:
                raise
            except Exception:  # the router must outlive a bad observation
                log.exception("rebalancer step failed")

    # ---- observing ----------------------------------------------------------------
    def _on_record(self, st) -> None:
        if len(st.token_times) > 1:
            tpot = (st.token_times[-1] - st.token_times[0]) / (len(st.token_times) - 1)
        else:
            tpot = 0.0
        self.recent.append((st.ttft_s, tpot))

    def _attainment(self) -> tuple[float | None, float | None]:
        return attainment(self.recent, self.slo_ms)

    def serving(self, role: str) -> list:
        return [w for w in self.cluster.role(role) if w.is_alive and not w.is_switching]

    async def observe(self) -> Observation:
        prefill, decode = self.serving("prefill"), self.serving("decode")
        waiting = [st for st in self.dispatcher.requests.values() if not st.token_times]
        active = len(self.dispatcher.requests) - len(waiting)
        # sent to prefill once the decode worker has their blocks: until then decode's queue
        blocked = [st for st in waiting if st.prefill is not None and not st.admitted]
        stats = await self.dispatcher.collect_stats(STATS_TIMEOUT_S, workers=decode)
        counted = {w.name: w for w in decode if w.name in stats}
        total = sum(w.info.get("num_blocks", 0) for w in counted.values())
        free = sum(stats[name].get("counters", {}).get("free_blocks", 0) for name in counted)
        # the blocks of admitted prompts still without a first token (their prompt's worth)
        reserved = sum(-(-len(st.prompt_ids) // int(counted[st.decode.name].info.get("block_size") or 16))
                       for st in waiting if st.admitted and st.decode is not None
                       and st.decode.name in counted)
        ttft_att, tpot_att = self._attainment()
        return Observation(time.monotonic(), len(prefill), len(decode), len(waiting) - len(blocked),
                           active, kv_use=(total - free) / total if total else 0.0,
                           admit_queue=len(blocked),
                           kv_reserved=min(reserved / total, 1.0) if total else 0.0,
                           ttft_attainment=ttft_att, tpot_attainment=tpot_att)

    # ---- acting -------------------------------------------------------------------
    async def execute(self, move: Move) -> bool:
        """Drain, switch and rejoin one worker of ``move.src``; True if it changed role."""
        candidates = [w for w in self.serving(move.src) if not w.is_draining]
        if len(candidates) < 2:  # never leave a role empty
            return False
        worker = min(candidates, key=lambda w: w.load)
        deadline = time.monotonic() + self.policy.drain_timeout_s
        log.info("rebalancing: moving %s %s -> %s (%s); draining %d requests", worker.name,
                 move.src, move.dst, move.reason, worker.load)
        worker.is_switching = True
        try:
            while worker.inflight and worker.is_alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if worker.inflight or not worker.is_alive:
                log.warning("rebalancing: %s not drained (%s); it stays %s", worker.name,
                            "died" if not worker.is_alive else f"{worker.load} requests left",
                            move.src)
                return False
            future = self._pending[worker.name] = asyncio.get_running_loop().create_future()
            self._reasons[worker.name] = move.reason
            worker.send({"op": "switch_role", "role": move.dst})
            try:
                reply = await asyncio.wait_for(future, max(deadline - time.monotonic(), 1.0))
            except asyncio.TimeoutError:
                log.warning("rebalancing: %s did not confirm the switch; it stays %s",
                            worker.name, move.src)
                return False
            if not reply.get("ok"):
                log.error("rebalancing: %s refused the switch: %s", worker.name, reply.get("error"))
                return False
            return True
        except ConnectionError as exc:
            log.warning("rebalancing: %s: %s", worker.name, exc)
            return False
        finally:
            self._pending.pop(worker.name, None)
            worker.is_switching = False

    def _on_role_changed(self, worker, msg: dict) -> None:
        """The worker's answer; its role is the truth even when the wait gave up."""
        if msg.get("ok") and msg.get("role") in ("prefill", "decode") and msg["role"] != worker.role:
            old, worker.role = worker.role, msg["role"]
            reason = self._reasons.pop(worker.name, "late")
            self.num_changes += 1
            self.state = changed(self.state, time.monotonic())
            self.m_changes.inc(**{"from": old, "to": worker.role, "reason": reason})
            log.warning("rebalancing: %s is now %s (was %s, reason %s; %s/%s KV blocks free)",
                        worker.name, worker.role, old, reason, msg.get("free_blocks"),
                        msg.get("num_blocks"))
        future = self._pending.get(worker.name)
        if future is not None and not future.done():
            future.set_result(msg)
