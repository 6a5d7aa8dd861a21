"""The connector's worker half: one kvxfer Agent per rank, never blocking a step.

Each tensor-parallel rank runs its own agent on its own slice of the pool (its kv
heads, :mod:`.tp`), named ``vllm-<role>-<engine>-tp<rank>of<size>``.

P: each :class:`SendSpec` becomes an :class:`.outbound.Outbound` that serves
every D rank holding some of this rank's heads -- as a whole after the forward
(``wait_for_save``), or, for a layer-by-layer request, one layer at a time from
``save_kv_layer`` as the forward writes it. The agent's ``on_release`` (a send's
lease ended: visible in D, cancelled, failed or expired) queues the wire id;
``get_transfer_results`` reports the request in ``finished_sending`` once its
Outbound settled *and* vLLM has finished the request (``finished_req_ids``), so the
scheduler frees the blocks never while a late write could still read them.

D: ``start_load_kv`` connects to the P ranks holding this rank's heads (once per
address, cached) and posts ``agent.recv(remote_req, tail_blocks, skip_blocks=k)``;
the agent completes it once every P rank delivered its heads. ``get_transfer_results``
reports ``finished_recving`` when the lease ends ``done`` and ``failed_recving``
otherwise (unreachable or dead P rank, unmappable heads, timeout, cancel): vLLM then
recomputes or fails the request per ``kv_load_failure_policy`` (a failure on any rank
fails the request). A recv one of whose P ranks disconnected before delivering is
cancelled at once rather than left to its timeout.

With ``store`` configured, a :class:`.pool.PoolMover` beside the agent loads
pool hits before the forward and puts computed blocks after it (never waiting);
their ends are reported through the same results as the agent's transfers.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

# a child of vLLM's logger, so transfers show in the engine's own log at INFO
log = logging.getLogger("vllm.kvxfer")


PREEMPT_WAIT_S = 30.0  # longest a step waits for a preempted request's sends to stop reading


class WorkerHalf:
    def __init__(self, config, engine_id: str = "0") -> None:
        self.config = config
        self.engine_id = engine_id
        self.name = None  # the agent's, once registered
        self.agent = None
        self.layout = None
        self.tp_rank, self.tp_size, self.num_kv_heads = 0, 1, 0
        self.layer_index: dict = {}  # vLLM layer name -> layer number
        self._ended: queue.SimpleQueue = queue.SimpleQueue()  # (lease request id, reason)
        self._wake = threading.Event()  # set after each put into _ended
        self._lock = threading.Lock()
        self._peers: dict = {}  # address -> Peer (D side)
        self._recvs: dict = {}  # remote request id -> (RecvSpec, handle, [Peer])
        self._failed: set = set()  # D request ids that failed before a recv was posted
        self._out: dict = {}  # P: request id -> Outbound
        self._by_wire: dict = {}  # P: wire id -> Outbound
        self._finished: set = set()  # P: request ids vLLM finished (their blocks may be reported)
        self._streams: list = []  # P: this step's layer-by-layer Outbounds
        self._streams_meta = None  # the step metadata _streams were opened for
        self.stats = {"sends": 0, "recvs": 0, "failed": 0, "bytes": 0, "seconds": 0.0}
        self.pool = None
        if config.store is not None:
            from .pool import PoolMover

            self.pool = PoolMover(config, self._wake)

    # ---- setup -----------------------------------------------------------------------
    def register(self, kv_caches: dict, vllm_config, tp_rank: int = 0, tp_size: int = 1) -> None:
        from ... import Agent, AgentConfig
        from .layout import cpu_layout
        from .tp import agent_name, rank_heads, rank_listen

        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        heads = rank_heads(self.num_kv_heads, tp_rank, tp_size)  # LayoutMismatch if replicated
        self.layout = cpu_layout(kv_caches, vllm_config, tp_rank=tp_rank, tp_size=tp_size)
        if self.layout.head_range != heads:
            raise ValueError(f"rank {tp_rank} of {tp_size} holds {self.layout.num_heads} kv heads; "
                             f"expected {heads[1] - heads[0]} of {self.num_kv_heads}")
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.name = agent_name(self.config.role, self.engine_id, tp_rank, tp_size)
        agent = Agent(self.name, listen=rank_listen(self.config.listen, tp_rank), secret=self.config.secret,
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

    @property
    def heads(self) -> tuple:
        return self.layout.head_range

    # ---- P ---------------------------------------------------------------------------------
    def _outbound(self, spec):
        from .outbound import Outbound

        old = self._out.get(spec.request_id)
        if old is not None:  # a preempted request prefilled again: the old sends were cancelled
            self._by_wire.pop(old.wire, None)
        ob = Outbound(spec, self.heads, self.num_kv_heads, self.config.lease_timeout)
        self._out[spec.request_id] = ob
        self._by_wire[ob.wire] = ob
        return ob

    def save_layer(self, meta, layer_name: str) -> None:
        """P, inside the forward: ``layer_name`` is written; ship it for this step's streams."""
        if meta is not self._streams_meta:
            self._streams_meta = meta
            self._streams = [self._outbound(s) for s in meta.sends if s.streaming]
        if not self._streams:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for ob in self._streams:
            ob.add_layer(self.agent, layer)

    def post_sends(self, meta) -> None:
        """P, after the forward (``wait_for_save``): close this step's streams, post the
        whole-request sends, log the end of each remote-decode prefill (monotonic s)."""
        if meta is not self._streams_meta:  # a step whose forward saved no layer
            self._streams_meta, self._streams = meta, [self._outbound(s) for s in meta.sends if s.streaming]
        now = time.monotonic()
        for ob in self._streams:
            ob.finish_layers()
        self._streams, self._streams_meta = [], None
        for spec in meta.sends:
            if not spec.streaming:
                self._outbound(spec).start(self.agent)
        for wire in meta.prefill_ends:
            log.info("kvxfer: prefill of %s ended at %.6f", wire, now)
        for req in meta.cancels:
            ob = self._out.get(req)
            if ob is not None:
                ob.cancel()

    def wait_sends(self, req_ids) -> None:
        """Preempted requests: cancel their sends and wait (bounded) until no write reads
        their blocks, which vLLM may hand to another request in this very step."""
        deadline = time.monotonic() + PREEMPT_WAIT_S
        for req in req_ids:
            ob = self._out.get(req)
            if ob is None:
                continue
            ob.cancel()
            while ob.leases > 0 and time.monotonic() < deadline:
                self._drain_ended()
                if ob.leases > 0:
                    self._wake.clear()
                    if self._ended.empty():
                        self._wake.wait(0.05)

    # ---- D ---------------------------------------------------------------------------------
    def _peer(self, address: str):
        peer = self._peers.get(address)
        if peer is None or not peer.is_connected:
            peer = self.agent.connect(address)
            self._peers[address] = peer
        return peer

    def post_recvs(self, specs) -> None:
        from ...errors import KVXferError
        from .tp import RankInfo, check_pair, overlapping, whole

        lo, hi = self.heads
        for spec in specs:
            ranks = whole(spec.ranks or (RankInfo(spec.remote_addr, 0, 0),), self.num_kv_heads)
            try:
                check_pair(ranks, spec.remote_kv_heads or self.num_kv_heads, self.num_kv_heads)
                peers = [self._peer(r.address) for r in overlapping(ranks, lo, hi)]
                handle = self.agent.recv(spec.remote_request_id, list(spec.block_ids),
                                         skip_blocks=spec.skip_blocks, timeout=self.config.recv_timeout)
            except (KVXferError, ValueError) as exc:
                log.warning("kvxfer: cannot load %s from %s: %s", spec.request_id,
                            [r.address for r in ranks], exc)
                self._failed.add(spec.request_id)
                continue
            self._recvs[spec.remote_request_id] = (spec, handle, peers)

    # ---- both: completions --------------------------------------------------------------------
    def results(self, idle_wait: float = 0.0, finished_req_ids=()) -> tuple:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        ``finished_req_ids``: requests vLLM finished (this step's scheduler output); a
        send is reported only for those. ``idle_wait`` (seconds; the step scheduled no
        tokens): while transfers are in flight and none has ended yet, sleep up to that
        long for one to end, so an idle engine does not spin through empty steps while
        the copy needs the CPU."""
        pool_busy = self.pool is not None and self.pool.busy
        if idle_wait > 0 and (self._out or self._recvs or pool_busy):
            self._wake.clear()
            # an end put after clear() sets _wake again
            if self._ended.empty() and (self.pool is None or not self.pool.has_news()):
                self._wake.wait(idle_wait)
        for spec, handle, peers in list(self._recvs.values()):
            if not handle.done() and any(not p.is_connected for p in peers):
                handle.cancel()  # a P rank left before it delivered: nobody will finish it; fail now
        sending, recving, failed = set(), set(), set(self._failed)
        self._failed.clear()
        for req, reason in self._drain_ended():
            entry = self._recvs.pop(req, None)
            if entry is None:
                continue
            spec, handle, _ = entry
            recving.add(spec.request_id)
            if reason != "done":
                log.warning("kvxfer: load of %s failed (%s: %r)", spec.request_id, reason, handle.error)
                failed.add(spec.request_id)
            self._account(handle, "recvs")
        sending |= self._settle_sends(finished_req_ids)
        self.stats["failed"] += len(failed)
        if self.pool is not None:
            released, loaded, pool_failed = self.pool.results()
            sending |= released
            recving |= loaded
            failed |= pool_failed
        return sending, recving | failed, failed

    def _drain_ended(self) -> list:
        """The recv leases that ended since the last call, ``[(wire id, reason)]``; a send's
        ending is counted on its Outbound."""
        recvs = []
        while True:
            try:
                req, reason = self._ended.get_nowait()
            except queue.Empty:
                return recvs
            ob = self._by_wire.get(req)
            if ob is not None and ob.leases > 0:
                ob.leases -= 1
            else:
                recvs.append((req, reason))

    def _settle_sends(self, finished_req_ids) -> set:
        """P: poll every Outbound; the finished requests whose sends settled."""
        if not self._out:
            return set()
        self._finished.update(finished_req_ids or ())
        posts: dict = {}
        if self.agent is not None and any(not ob.cancelled and not ob.failed for ob in self._out.values()):
            for peer, req, _ in self.agent.pending_recvs():
                if req in self._by_wire:
                    posts.setdefault(req, []).append(peer)
        sending = set()
        for req, ob in list(self._out.items()):
            ob.poll(self.agent, posts.get(ob.wire, ()))
            for handle in ob.ended:
                self._account(handle, "sends")
            ob.ended.clear()
            if not ob.settled() or req not in self._finished:
                continue
            del self._out[req]
            if self._by_wire.get(ob.wire) is ob:
                del self._by_wire[ob.wire]
            self._finished.discard(req)
            if self.pool is not None and self.pool.has_puts(req):
                self.pool.hold([req])  # its blocks go back once the pool's puts ended too
            else:
                sending.add(req)
        self._finished &= set(self._out)
        return sending

    def _account(self, handle, key: str) -> None:
        if handle.state == "done":
            seconds = (handle.finished or handle.created) - handle.created
            self.stats[key] += 1
            self.stats["bytes"] += handle.nbytes
            self.stats["seconds"] += seconds
            if key == "recvs":
                log.info("kvxfer: loaded %s: %d B in %.6f s (path %s) at %.6f", handle.request_id,
                         handle.nbytes, seconds, handle.path, handle.finished or handle.created)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.agent is not None:
            self.agent.close()
