"""The connector's scheduler half: decides what moves, holds P's blocks (leases).

P (``kv_producer``): a request with ``kv_transfer_params["do_remote_decode"]``
runs its prefill as usual; at ``request_finished`` the half keeps the prompt's
blocks (returns ``True``), queues a :class:`SendSpec` for the worker and returns
the params D needs (``do_remote_prefill``, ``remote_addr``,
``remote_request_id``, ``remote_num_tokens``). The blocks are freed when the
worker reports the send finished -- data visible in D, cancelled, failed, or
the lease expired (``lease_timeout``) -- through ``finished_sending``.

D (``kv_consumer``): a request with ``do_remote_prefill`` reports the prompt
tokens it does not hold locally as external and asynchronous; after vLLM
allocated blocks, the half queues a :class:`RecvSpec` naming only the blocks
D's prefix cache did not supply (the tail) and how many it skipped.

With ``store`` configured (any role; ``kv_both`` is a plain engine with a pool),
every other request consults the pool for the blocks beyond vLLM's own prefix
hits and puts the prompt blocks it computes (:class:`.vllm_pool.PoolPlanner`).
"""
from __future__ import annotations

from .vllm_meta import RecvSpec, SendSpec, XferMeta


def _group0(block_ids) -> list:
    """vLLM passes one list per KV cache group (or a flat list); Llama has one group."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise ValueError("KVXferConnector supports models with one KV cache group")
        return list(block_ids[0])
    return list(block_ids or ())


class SchedulerHalf:
    def __init__(self, config, block_size: int, vllm_config=None) -> None:
        self.config = config
        self.block_size = block_size
        self.pool = None
        if config.store is not None:
            from .vllm_pool import PoolPlanner

            self.pool = PoolPlanner(config, vllm_config, block_size)
        self.kv_cache_manager = None  # bound by the connector (block ids of running requests)
        self.address: str | None = None  # P's agent, from the worker's handshake metadata
        self._sends: list = []
        self._recvs: list = []
        self._held: set = set()  # P: requests whose blocks wait for finished_sending

    # ---- handshake -----------------------------------------------------------------
    def set_handshake(self, metadata: dict) -> None:
        if len(metadata) != 1:
            raise ValueError("KVXferConnector supports one worker per engine (tensor_parallel_size=1)")
        (meta,) = metadata.values()
        self.address = meta.address

    # ---- D: what to load ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple:
        params = request.kv_transfer_params
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
        self._recvs.append(RecvSpec(request.request_id, str(params["remote_addr"]),
                                    str(params["remote_request_id"]), tail, skip))

    # ---- both: per-step metadata -----------------------------------------------------------
    def build_meta(self, scheduler_output) -> XferMeta:
        meta = XferMeta(self._sends, self._recvs, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._sends, self._recvs = [], []
        if self.pool is not None:
            self.pool.plan_puts(scheduler_output.num_scheduled_tokens,
                                lambda req_id: _group0(self.kv_cache_manager.get_block_ids(req_id)))
            meta.pool_loads, meta.pool_puts, meta.pool_holds = self.pool.take()
            meta.preempted = tuple(scheduler_output.preempted_req_ids or ())
        return meta

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

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing to hand over
        if self.address is None:
            raise RuntimeError("KVXferConnector: the worker's agent address never reached the scheduler")
        num_tokens = len(request.prompt_token_ids)
        ids = _group0(block_ids)[:-(-num_tokens // self.block_size)]
        if not ids:
            return False, None
        self._sends.append(SendSpec(request.request_id, tuple(ids)))
        self._held.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_addr": self.address, "remote_request_id": request.request_id,
                      "remote_num_tokens": num_tokens}

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
