"""The connector's worker half: one kvxfer Agent per engine, never blocking a step.

P: ``wait_for_save`` posts ``agent.send(None, req, prompt_blocks)`` for each
:class:`SendSpec` (matched by whichever D posts that id); the agent's
``on_release`` (transfer visible, cancelled, failed or lease expired) queues the
id, and ``get_transfer_results`` reports it in ``finished_sending`` so the
scheduler frees the blocks -- never while a late write could still read them.

D: ``start_load_kv`` connects to P (once per address, cached) and posts
``agent.recv(remote_req, tail_blocks, skip_blocks=k)``; ``get_transfer_results``
reports ``finished_recving`` when the lease ends ``done`` and ``failed_recving``
otherwise (unreachable or dead P, timeout, cancel): vLLM then recomputes or fails
the request per ``kv_load_failure_policy``. A recv whose P disconnected before
matching is cancelled at once rather than left to its timeout.

With ``store`` configured, a :class:`.vllm_pool.PoolMover` beside the agent loads
pool hits before the forward and puts computed blocks after it (never waiting);
their ends are reported through the same results as the agent's transfers.
"""
from __future__ import annotations

import logging
import queue
import threading

# a child of vLLM's logger, so transfers show in the engine's own log at INFO
log = logging.getLogger("vllm.kvxfer")


class WorkerHalf:
    def __init__(self, config, name: str) -> None:
        self.config = config
        self.name = name
        self.agent = None
        self.layout = None
        self._ended: queue.SimpleQueue = queue.SimpleQueue()  # (lease request id, reason)
        self._wake = threading.Event()  # set after each put into _ended
        self._lock = threading.Lock()
        self._peers: dict = {}  # address -> Peer (D side)
        self._recvs: dict = {}  # remote request id -> (RecvSpec, handle, peer)
        self._failed: set = set()  # D request ids that failed before a recv was posted
        self._sends: dict = {}  # request id -> handle (P side)
        self.stats = {"sends": 0, "recvs": 0, "failed": 0, "bytes": 0, "seconds": 0.0}
        self.pool = None
        if config.store is not None:
            from .vllm_pool import PoolMover

            self.pool = PoolMover(config, self._wake)

    # ---- setup -----------------------------------------------------------------------
    def register(self, kv_caches: dict, vllm_config) -> None:
        from .. import Agent, AgentConfig
        from .vllm_layout import cpu_layout

        self.layout = cpu_layout(kv_caches, vllm_config)
        agent = Agent(self.name, listen=self.config.listen, secret=self.config.secret,
                      config=AgentConfig.from_env(lease_timeout=self.config.lease_timeout,
                                                  path=self.config.path),
                      on_release=self._on_release)
        try:
            agent.register_kv(self.layout)
        except BaseException:
            agent.close()
            raise
        self.agent = agent
        if self.pool is not None:
            self.pool.open(self.layout)
        log.info("kvxfer agent %s at %s, %s", self.name, agent.address, self.layout.fingerprint())

    def _on_release(self, request_id: str, block_ids, reason: str) -> None:
        self._ended.put((request_id, reason))
        self._wake.set()

    # ---- P ---------------------------------------------------------------------------------
    def post_sends(self, specs) -> None:
        for spec in specs:
            self._sends[spec.request_id] = self.agent.send(None, spec.request_id, list(spec.block_ids))

    # ---- D ---------------------------------------------------------------------------------
    def _peer(self, address: str):
        peer = self._peers.get(address)
        if peer is None or not peer.is_connected:
            peer = self.agent.connect(address)
            self._peers[address] = peer
        return peer

    def post_recvs(self, specs) -> None:
        from ..errors import KVXferError

        for spec in specs:
            try:
                peer = self._peer(spec.remote_addr)
                handle = self.agent.recv(spec.remote_request_id, list(spec.block_ids),
                                         skip_blocks=spec.skip_blocks, timeout=self.config.recv_timeout)
            except (KVXferError, ValueError) as exc:
                log.warning("kvxfer: cannot load %s from %s: %s", spec.request_id, spec.remote_addr, exc)
                self._failed.add(spec.request_id)
                continue
            self._recvs[spec.remote_request_id] = (spec, handle, peer)

    # ---- both: completions --------------------------------------------------------------------
    def results(self, idle_wait: float = 0.0) -> tuple:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        ``idle_wait`` (seconds; the step scheduled no tokens): while transfers are in
        flight and none has ended yet, sleep up to that long for one to end, so an
        idle engine does not spin through empty steps while the copy needs the CPU."""
        pool_busy = self.pool is not None and self.pool.busy
        if idle_wait > 0 and (self._sends or self._recvs or pool_busy):
            self._wake.clear()
            # an end put after clear() sets _wake again
            if self._ended.empty() and (self.pool is None or not self.pool.has_news()):
                self._wake.wait(idle_wait)
        for spec, handle, peer in list(self._recvs.values()):
            if not handle.done() and not peer.is_connected and handle.peer is None:
                handle.cancel()  # P left before it matched: nobody will write; fail now
        sending, recving, failed = set(), set(), set(self._failed)
        self._failed.clear()
        while True:
            try:
                req, reason = self._ended.get_nowait()
            except queue.Empty:
                break
            handle = self._sends.pop(req, None)
            if handle is not None:
                if self.pool is not None and self.pool.has_puts(req):
                    self.pool.hold([req])  # its blocks go back once the pool's puts ended too
                else:
                    sending.add(req)
                self._account(handle, "sends")
                continue
            entry = self._recvs.pop(req, None)
            if entry is None:
                continue
            spec, handle, _ = entry
            recving.add(spec.request_id)
            if reason != "done":
                log.warning("kvxfer: load of %s failed (%s: %r)", spec.request_id, reason, handle.error)
                failed.add(spec.request_id)
            self._account(handle, "recvs")
        self.stats["failed"] += len(failed)
        if self.pool is not None:
            released, loaded, pool_failed = self.pool.results()
            sending |= released
            recving |= loaded
            failed |= pool_failed
        return sending, recving | failed, failed

    def _account(self, handle, key: str) -> None:
        if handle.state == "done":
            seconds = (handle.finished or handle.created) - handle.created
            self.stats[key] += 1
            self.stats["bytes"] += handle.nbytes
            self.stats["seconds"] += seconds
            if key == "recvs":
                log.info("kvxfer: loaded %s: %d B in %.6f s (path %s)", handle.request_id, handle.nbytes,
                         seconds, handle.path)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.agent is not None:
            self.agent.close()
