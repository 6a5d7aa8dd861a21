"""Workers on any host, found through discovery (``kvxfer serve --discovery URL``).

:class:`RemoteCluster` has the interface of :class:`kvxfer.serving.server.launcher.Cluster`
(``workers``, ``pick``, ``start``, ``stop``, ``health``) but spawns nothing: it
watches the discovery prefix (:mod:`kvxfer.discovery`) and connects to each
published worker's control address (:mod:`kvxfer.serving.channel.netchannel`,
authenticated with the shared secret).

- A worker that appears is connected at once and takes requests as soon as its
  ``ready`` arrives (the watch polls every 0.5 s).
- A worker whose connection ends (killed, crashed) is out of rotation at once and
  its in-flight requests fail or are recomputed (``on_worker_exit``, the same
  policy as local workers); while it is still published the router reconnects
  with a backoff (1 s doubling to 10 s).
- A worker that stops being published (lease expired: a dead host, a partition)
  is dropped within the lease TTL plus one poll.
- ``stop()`` closes the connections only: the workers keep running, abort what
  this router handed them, and a restarted router finds them again (and asks each
  for its prefix cache's hashes, ``op: kv_snapshot``, for the routing index).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from ...errors import KVXferError
from .serve_config import ServeConfig
from .worker_ref import WorkerRef, relay_messages

log = logging.getLogger("kvxfer.serve")

CONNECT_TIMEOUT_S = 10.0
RECONNECT_BACKOFF_S = (1.0, 10.0)  # first, max


class RemoteWorker(WorkerRef):
    """One discovered worker and the router's connection to it."""

    def __init__(self, member):
        super().__init__(member.name, member.role)
        self.member = member
        self.key = member.name
        self.address = member.address
        self.connects = 0
        self.failures = 0
        self.connected_at = 0.0

    def __repr__(self) -> str:
        return f"RemoteWorker({self.name}@{self.address}, {'alive' if self.is_alive else 'down'})"

    def health(self) -> dict:
        return {"name": self.name, "role": self.role, "alive": self.is_alive,
                "address": self.address, "agent_address": self.agent_address,
                "pid": self.info.get("pid"), "exit_code": None, "inflight": self.load,
                "draining": self.is_draining, "connects": self.connects,
                "matmul": self.info.get("matmul"), "transport": self.info.get("transport")}


class RemoteCluster:
    """See the module docstring."""

    def __init__(self, config: ServeConfig, on_message: Callable, on_worker_exit: Callable):
        from ...discovery import open_discovery
        from ...secrets import load_secret

        self.config = config
        self.discovery = open_discovery(config.discovery)
        self._secret = load_secret(config.secret_file, remove=True)
        self._on_message = on_message
        self._on_worker_exit = on_worker_exit
        self._by_key: dict[str, RemoteWorker] = {}
        self._members: dict = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch = None
        self._is_stopping = False
        self.model_name: str | None = None  # set by the router: other models' workers are ignored
        self.routing = config.routing_policy()  # its prefix index follows the workers' kv_events

    @property
    def workers(self) -> list[RemoteWorker]:
        return list(self._by_key.values())

    def role(self, role: str) -> list[RemoteWorker]:
        return [w for w in self._by_key.values() if w.role == role]

    def pick(self, role: str, prompt_ids: list[int] | None = None) -> RemoteWorker | None:
        """The live worker of ``role`` the routing policy picks for ``prompt_ids``."""
        return self.route(role, prompt_ids).worker

    def route(self, role: str, prompt_ids: list[int] | None = None, **booking):
        """:meth:`pick` as a :class:`~kvxfer.serving.server.routing.Route` (with its prefix
        hit); ``booking``: ``request_id``, ``max_tokens``, ``prefills`` (the policy's ledger)."""
        live = [w for w in self.role(role) if w.is_alive and not w.is_draining]
        return self.routing.route(live, prompt_ids, **booking)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watch = self.discovery.watch(self._on_members_threadsafe)
        log.info("discovering workers through %s", self.config.discovery)

    def _on_members_threadsafe(self, members: dict) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._apply, members)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _apply(self, members: dict) -> None:
        if self._is_stopping:
            return
        mine = {k: m for k, m in members.items()
                if self.model_name is None or m.model in (None, self.model_name)}
        for key in set(members) - set(mine):
            if key not in self._members:
                log.warning("ignoring worker %s: model %s, this router serves %s",
                            key, members[key].model, self.model_name)
        self._members = mine
        for key, w in list(self._by_key.items()):
            m = mine.get(key)
            if m is None or m.address != w.address:
                log.warning("worker %s left discovery", w.name)
                self._drop(w)
        for key, m in mine.items():
            if key not in self._by_key:
                w = self._by_key[key] = RemoteWorker(m)
                log.info("worker %s (%s) joined at %s", m.name, m.role or "role from worker", m.address)
                self._spawn(self._connect(w), f"connect-{key}")

    async def _connect(self, w: RemoteWorker) -> None:
        from ..channel.netchannel import connect_worker

        while not self._is_stopping and self._by_key.get(w.key) is w:
            try:
                channel, ready = await connect_worker(w.address, self._secret, CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError, KVXferError) as exc:
                w.failures += 1
                delay = min(RECONNECT_BACKOFF_S[0] * 2 ** min(w.failures - 1, 8), RECONNECT_BACKOFF_S[1])
                log.warning("cannot reach worker %s at %s (%s: %s); retrying in %.0fs",
                            w.name, w.address, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                continue
            if self._is_stopping or self._by_key.get(w.key) is not w:
                channel.close()
                return
            if ready.get("ev") != "ready" or ready.get("role") not in ("prefill", "decode") \
                    or (w.role and ready.get("role") != w.role):
                log.error("worker at %s announced %s; not using it", w.address, ready.get("role"))
                channel.close()
                self._by_key.pop(w.key, None)
                return
            w.channel, w.info, w.role = channel, ready, ready["role"]
            w.name = str(ready.get("name") or w.name)
            w.is_alive, w.failures, w.connected_at = True, 0, time.monotonic()
            if type(ready.get("num_blocks")) is int and ready["num_blocks"] > 0:
                self.routing.set_capacity(w.name, ready["num_blocks"])
            w.send({"op": "kv_snapshot"})  # a running worker's cache, for the routing index
            w.connects += 1
            log.info("worker %s (%s) connected at %s, agent %s", w.name, w.role, w.address,
                     w.agent_address)
            await self._read(w)
            if not self._is_stopping and self._by_key.get(w.key) is w:
                await asyncio.sleep(RECONNECT_BACKOFF_S[0])  # still published: try again

    async def _read(self, w: RemoteWorker) -> None:
        await relay_messages(w, self._on_message)
        self._mark_dead(w, "connection lost")

    def _mark_dead(self, w: RemoteWorker, why: str) -> None:
        if w.channel is not None:
            w.channel.close()
        if not w.is_alive:
            return
        w.is_alive = False
        if not self._is_stopping:
            log.error("worker %s: %s; failing its %d in-flight requests", w.name, why, w.load)
        self._on_worker_exit(w)

    def _drop(self, w: RemoteWorker) -> None:
        self._by_key.pop(w.key, None)
        self._mark_dead(w, "left discovery")

    async def stop(self) -> None:
        """Disconnect from every worker (they keep running) and stop watching."""
        self._is_stopping = True
        if self._watch is not None:
            await asyncio.to_thread(self._watch.stop)
        for w in list(self._by_key.values()):
            self._mark_dead(w, "router stopping")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.discovery.close()

    def health(self) -> dict:
        workers = [w.health() for w in self._by_key.values()]
        serving = all(any(w.is_alive for w in self.role(r)) for r in ("prefill", "decode"))
        degraded = any(not w.is_alive for w in self._by_key.values())
        status = "ok" if serving and not degraded else ("degraded" if serving else "down")
        return {"status": status, "mode": "disaggregated", "discovery": self.config.discovery,
                "workers": workers}
