"""The message loop every worker role shares: inbox, stats, drain, exit.

A role subclass implements ``on_<op>`` handlers, ``tick()`` (one unit of work:
poll transfers, run one model step), ``has_work()`` (holds any request) and
``is_busy()`` (a step would do something now). The loop blocks on the inbox
only while idle, so a busy worker never waits for a message.

Prefix-cache events: a role runs its model step through :meth:`WorkerLoop.step`,
which then sends the hashes that entered and left the runtime's prefix cache
since the previous step (``BlockManager.drain_events``) as ``ev: kv_events``
messages of at most ``MAX_EVENT_HASHES`` hashes, before any token of the step,
so the router's routing index (:mod:`kvxfer.serving.server.routing`) follows the
cache and a router that saw a request finish knows the blocks it cached.
``op: kv_snapshot`` (a router that connects to a running worker) is answered with
every hash the cache holds, as ``stored`` events.

Role switch (``op: switch_role``, adaptive P/D rebalancing): the worker stops
taking requests, finishes what it holds, and :meth:`WorkerLoop.run` returns with
``next_role`` set; ``workers/main.py`` then checks every KV block is free and
builds the new role's loop over the same runtime and agent.
"""
from __future__ import annotations

import logging
import queue
import signal
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..channel.ipc import kv_event_batches

if TYPE_CHECKING:
    from ... import Agent
    from ..engine.runtime import Runtime
    from ..channel.ipc import WorkerChannel
    from ..channel.netchannel import NetWorkerChannel

log = logging.getLogger("kvxfer.worker")

IDLE_WAIT_S = 0.5  # nothing held: wake up for messages only
POLL_WAIT_S = 0.002  # transfers pending: poll their handles this often


@dataclass
class WorkerContext:
    name: str
    role: str
    channel: WorkerChannel | NetWorkerChannel
    runtime: Runtime
    agent: Agent | None  # None when colocated
    transfer_timeout_s: float
    on_transfer_failure: str
    released: queue.SimpleQueue | None = None  # request ids whose agent lease ended
    request_timeout_s: float = 600.0
    # prefill: decode agent address -> kvxfer.Peer, kept across role switches
    peers: dict = field(default_factory=dict)
    pool: object | None = None  # prefill: a workers.pool.PrefillPool (--store), kept across role switches


class WorkerLoop:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.runtime = ctx.runtime
        self.agent = ctx.agent
        self.counters: dict[str, float] = {}
        self.is_draining = False
        self.next_role: str | None = None  # set by switch_role: run() returns once drained
        self.runtime.blocks.record_events()  # idempotent: a role switch keeps the cache
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # Ctrl-C reaches the whole process group; the router drains us instead.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_sigterm(self, signum, frame) -> None:
        self.is_draining = True

    def send(self, msg: dict) -> None:
        self.ctx.channel.send(msg)

    # role hooks
    def has_work(self) -> bool:
        raise NotImplementedError

    def is_busy(self) -> bool:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        return {}

    def run(self) -> int:
        """Serve until ``shutdown``/SIGTERM (after draining) or the router goes away."""
        inbox = self.ctx.channel.inbox
        while True:
            wait = 0.0 if self.is_busy() else (POLL_WAIT_S if self.has_work() else IDLE_WAIT_S)
            try:
                msg = inbox.get(timeout=wait) if wait else inbox.get_nowait()
                while True:
                    if not self._handle(msg):
                        return 0
                    msg = inbox.get_nowait()
            except queue.Empty:
                pass
            self.tick()
            if self.is_draining and not self.has_work():
                return 0

    def _handle(self, msg: dict) -> bool:
        op = msg.get("op")
        if op == "eof":  # router gone: nobody to answer to
            return False
        if op == "shutdown":
            self.is_draining, self.next_role = True, None
            return True
        if op == "switch_role":
            if msg.get("role") not in ("prefill", "decode") or self.ctx.role == "colocated":
                self.send({"ev": "role_changed", "ok": False, "role": self.ctx.role,
                           "error": f"cannot switch {self.ctx.role} to {msg.get('role')!r}"})
            elif not self.is_draining:
                self.is_draining, self.next_role = True, msg["role"]
            return True
        if op == "kv_snapshot":
            self._send_kv_events(self.runtime.blocks.cached_hashes(), [])
            return True
        if op == "stats":
            info = dict(self.agent.metrics.info) if self.agent is not None else {}
            self.send({"ev": "stats", "qid": msg.get("qid"), "counters": self._all_stats(),
                       "info": info})
            return True
        rid = msg.get("rid")
        if op in ("admit", "prefill") and self.is_draining:
            self.send({"ev": "error", "rid": rid, "kind": "shutting_down",
                       "error": "worker is shutting down"})
            return True
        handler = getattr(self, f"on_{op}", None)
        if handler is None:
            log.error("%s: unknown op %r", self.ctx.name, op)
            return True
        try:
            handler(msg)
        except Exception as exc:  # a bad request fails alone, the worker goes on
            log.error("%s: %s %s failed:\n%s", self.ctx.name, op, rid, traceback.format_exc())
            if rid is not None:
                self.send({"ev": "error", "rid": rid, "kind": "worker_error",
                           "error": f"{type(exc).__name__}: {exc}"})
        return True

    def step(self):
        """``runtime.step()``, then publish the cache events (module docstring)."""
        step = self.runtime.step()
        self._publish_kv_events()
        return step

    def _publish_kv_events(self) -> None:
        self._send_kv_events(*self.runtime.blocks.drain_events())

    def _send_kv_events(self, stored: list[int], removed: list[int]) -> None:
        for part_stored, part_removed in kv_event_batches(stored, removed):
            self.send({"ev": "kv_events", "stored": part_stored, "removed": part_removed})

    def _all_stats(self) -> dict:
        stats = dict(self.counters)
        blocks = self.runtime.blocks
        stats.update(prefix_query_tokens=blocks.num_query_tokens,
                     prefix_hit_tokens=blocks.num_hit_tokens)
        stats.update(self.stats())
        if self.agent is not None:
            stats.update(agent_counters(self.agent))
        return stats


def token_event(rid: str, token: int, logprobs: dict | None) -> dict:
    """The ``ev: token`` message; ``logprobs`` (when the request asked for them) is
    :func:`kvxfer.serving.engine.sampling.token_logprobs` of the sampled position."""
    msg = {"ev": "token", "rid": rid, "token": token}
    if logprobs is not None:
        msg["logprobs"] = logprobs
    return msg


def agent_counters(agent) -> dict:
    """The agent's counters summed over labels, as ``agent_<name>`` numbers."""
    metrics = getattr(agent, "metrics", None)
    if metrics is None or not hasattr(metrics, "to_dict"):
        return {}
    data = metrics.to_dict()
    out: dict[str, float] = {}
    for name, rows in data.get("counters", {}).items():
        out[f"agent_{name}"] = sum(row["value"] for row in rows)
    for name, rows in data.get("histograms", {}).items():
        out[f"agent_{name}_count"] = sum(row["count"] for row in rows)
        out[f"agent_{name}_sum"] = sum(row["sum"] for row in rows)
    return out
