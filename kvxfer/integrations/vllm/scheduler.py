"""The connector's scheduler half: decides what moves, holds P's blocks (leases).

P (``kv_producer``): a request with ``kv_transfer_params["do_remote_decode"]``
runs its prefill as usual. Layer by layer (``layerwise``: the engine's
``kv_connector_extra_config`` or the request's params), the step whose forward
completes the prompt carries a streaming :class:`SendSpec`, and the worker ships
each layer as the forward writes it. Otherwise, at ``request_finished``, the half
keeps the prompt's blocks (returns ``True``) and queues a whole-request
:class:`SendSpec`. Either way it returns the params D needs: ``do_remote_prefill``,
every rank's agent (``remote_ranks``: address and kv heads; ``remote_addr``: rank
0's), ``remote_kv_heads``, ``remote_request_id`` (the wire id: the request's own
id, or the proxy's ``transfer_id``) and ``remote_num_tokens``. The blocks are freed
when every rank's worker reports the sends settled (vLLM waits for all of them)
through ``finished_sending``.

D (``kv_consumer``): a request with ``do_remote_prefill`` reports the prompt
tokens it does not hold locally as external and asynchronous; after vLLM
allocated blocks, the half queues a :class:`RecvSpec` naming only the blocks
D's prefix cache did not supply (the tail), how many it skipped, and P's ranks.

With ``store`` configured (any role; ``kv_both`` is a plain engine with a pool),
every other request consults the pool for the blocks beyond vLLM's own prefix
hits and puts the prompt blocks it computes (:class:`.pool.PoolPlanner`).
"""
from __future__ import annotations

import logging

from .meta import RecvSpec, SendSpec, XferMeta
from .tp import RankInfo, parse_ranks, ranks_param

log = logging.getLogger("vllm.kvxfer")


def _group0(block_ids) -> list:
    """vLLM passes one list per KV cache group (or a flat list); Llama has one group."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise ValueError("KVXferConnector supports models with one KV cache group")
        return list(block_ids[0])
    return list(block_ids or ())


def _wire_id(request) -> str:
    """The id P's sends and D's recv match on: the proxy's ``transfer_id`` (D posted its
    recv before P finished) or the request's own id."""
    return str((request.kv_transfer_params or {}).get("transfer_id") or request.request_id)


class SchedulerHalf:
    def __init__(self, config, block_size: int, vllm_config=None) -> None:
        self.config = config
        self.block_size = block_size
        self.pool = None
        if config.store is not None:
            from .pool import PoolPlanner

            self.pool = PoolPlanner(config, vllm_config, block_size)
        self.kv_cache_manager = None  # bound by the connector (block ids of running requests)
        self.ranks: tuple = ()  # P's agents (RankInfo, rank order), from the workers' handshake metadata
        self.num_kv_heads = 0
        self._sends: list = []
        self._recvs: list = []
        self._cancels: list = []
        self._held: set = set()  # P: requests whose blocks wait for finished_sending
        self._remote: dict = {}  # P: request id -> remote-decode request not finished yet
        self._streaming: set = set()  # P: requests whose layers are being (or were) streamed

    @property
    def address(self) -> str | None:
        """Rank 0's agent address (None before the handshake)."""
        return self.ranks[0].address if self.ranks else None

    # ---- handshake -----------------------------------------------------------------
    def set_handshake(self, metadata: dict) -> None:
        """``{tp_rank: XferHandshake}`` of every worker of this engine."""
        if not metadata:
            raise ValueError("KVXferConnector: no worker reported its agent")
        metas = [metadata[r] for r in sorted(metadata)]
        size = metas[0].tp_size
        if sorted(metadata) != list(range(size)) or any(m.tp_size != size for m in metas):
            raise ValueError(f"KVXferConnector: agents of ranks {sorted(metadata)} reported, "
                             f"expected 0..{size - 1}")
        self.num_kv_heads = metas[0].num_kv_heads
        self.ranks = tuple(RankInfo(m.address, m.lo, m.hi) for m in metas)

    # ---- D: what to load ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple:
        params = request.kv_transfer_params
        if self.config.role == "producer" and params and params.get("do_remote_decode"):
            self._remote[request.request_id] = request  # its prefill's end is tracked (build_meta)
        if self.config.role != "consumer" or not params or not params.get("do_remote_prefill"):
            if self.pool is None:
                return 0, False
            count = self.pool.match(request, num_computed_tokens)
            return (count, True) if count > 0 else (0, False)
        count = len(request.prompt_token_ids) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.config.role != "consumer" or not params or not params.get("do_remote_prefill"):
            if self.pool is not None:
                self.pool.allocated(request, [b.block_id for b in blocks.blocks[0]], num_external_tokens)
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if called again
        if num_external_tokens <= 0:
            return
        group = blocks.blocks[0]
        total = -(-len(request.prompt_token_ids) // self.block_size)
        skip = sum(1 for b in group if b.block_hash is not None)  # D's own prefix-cache hits
        tail = tuple(b.block_id for b in group[skip:total])
        try:
            ranks, p_heads = parse_ranks(params)
            error = ""
        except (KeyError, ValueError) as exc:
            ranks, p_heads, error = (), 0, str(exc)
        self._recvs.append(RecvSpec(request.request_id, ranks[0].address if ranks else "",
                                    str(params.get("remote_request_id")), tail, skip, ranks, p_heads, error))

    # ---- both: per-step metadata -----------------------------------------------------------
    def build_meta(self, scheduler_output) -> XferMeta:
        meta = XferMeta(self._sends, self._recvs, idle=scheduler_output.total_num_scheduled_tokens == 0,
                        cancels=self._cancels)
        self._sends, self._recvs, self._cancels = [], [], []
        meta.preempted = tuple(scheduler_output.preempted_req_ids or ())
        self._streaming.difference_update(meta.preempted)  # prefilled again: a new stream
        if self._remote:
            self._plan_prefill_ends(meta, scheduler_output.num_scheduled_tokens)
        if self.pool is not None:
            self.pool.plan_puts(scheduler_output.num_scheduled_tokens,
                                lambda req_id: _group0(self.kv_cache_manager.get_block_ids(req_id)))
            meta.pool_loads, meta.pool_puts, meta.pool_holds = self.pool.take()
        return meta

    def _layerwise(self, request) -> bool:
        value = (request.kv_transfer_params or {}).get("layerwise")
        return self.config.layerwise if value is None else bool(value)

    def _plan_prefill_ends(self, meta, num_scheduled_tokens: dict) -> None:
        """P: remote-decode requests whose prompt this step completes: their end is logged,
        and layer-by-layer ones stream from this step's forward."""
        for req_id, n in num_scheduled_tokens.items():
            request = self._remote.get(req_id)
            if request is None or req_id in self._streaming:
                continue
            num_prompt = len(request.prompt_token_ids)
            if request.num_computed_tokens + n < num_prompt:
                continue  # an earlier chunk of a chunked prefill
            wire = _wire_id(request)
            meta.prefill_ends.append(wire)
            if self._layerwise(request):
                ids = _group0(self.kv_cache_manager.get_block_ids(req_id))[:-(-num_prompt // self.block_size)]
                meta.sends.append(SendSpec(req_id, tuple(ids), wire, streaming=True))
                self._streaming.add(req_id)

    # ---- P: hold blocks until the worker says the transfer ended -------------------------------
    def request_finished(self, request, block_ids) -> tuple:
        held, params = self._handover(request, block_ids)
        if self.pool is not None and self.pool.finished(request, held_for_send=held):
            return True, params  # the worker reports it once its puts stopped reading the blocks
        return held, params

    def _handover(self, request, block_ids) -> tuple:
        """P: hold a finished remote-decode request's blocks for D; ``(held, params)``."""
        params = request.kv_transfer_params
        if self.config.role != "producer" or not params or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._remote.pop(req_id, None)
        streamed = req_id in self._streaming
        self._streaming.discard(req_id)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if not streamed:
                return False, None  # aborted: nothing to hand over
            self._cancels.append(req_id)  # its layers may be on the wire: cancel, hold until they stop
            self._held.add(req_id)
            return True, None
        if not self.ranks:
            raise RuntimeError("KVXferConnector: the workers' agent addresses never reached the scheduler")
        num_tokens = len(request.prompt_token_ids)
        ids = _group0(block_ids)[:-(-num_tokens // self.block_size)]
        if not ids and not streamed:
            return False, None
        if not streamed:
            self._sends.append(SendSpec(req_id, tuple(ids), _wire_id(request)))
        self._held.add(req_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_addr": self.address, "remote_ranks": ranks_param(self.ranks),
                      "remote_kv_heads": self.num_kv_heads, "remote_request_id": _wire_id(request),
                      "remote_num_tokens": num_tokens, "layerwise": self._layerwise(request)}

    def finished_sending(self, req_ids) -> None:
        self._held.difference_update(req_ids or ())
        if self.pool is not None:
            self.pool.holding.difference_update(req_ids or ())

    def has_pending_push_work(self) -> bool:
        """P keeps its engine stepping while blocks are lent, so the worker reports ends
        (and an engine with a pool while finished requests' blocks wait for puts)."""
        return bool(self._held or self._sends or (self.pool is not None and self.pool.holding))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
