"""What the connector's scheduler half tells its worker half each step, and the
worker's address handed back to the scheduler (all picklable: vLLM may run the
worker in another process)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata,
                                                                KVConnectorMetadata)


@dataclass(frozen=True)
class SendSpec:
    """P: ship ``block_ids`` (the prompt's blocks, in token order) of ``request_id``
    as ``wire_id`` to every D rank that posts a recv for that id and holds some of
    this rank's heads. ``streaming``: this step's forward finishes the prompt and
    ships each layer as it is written (``save_kv_layer``); else the whole request
    goes after the forward (``wait_for_save``)."""

    request_id: str
    block_ids: tuple
    wire_id: str = ""
    streaming: bool = False

    @property
    def wire(self) -> str:
        return self.wire_id or self.request_id


@dataclass(frozen=True)
class RecvSpec:
    """D: load P's request ``remote_request_id`` from the agent at ``remote_addr``
    into ``block_ids`` (the tail of the prompt's blocks); D's own prefix cache
    already holds P's first ``skip_blocks`` blocks."""

    request_id: str  # D's request id (what the scheduler waits on)
    remote_addr: str
    remote_request_id: str
    block_ids: tuple
    skip_blocks: int
    # P's ranks (tp.RankInfo, rank order); each D rank loads from those holding its heads
    ranks: tuple = ()
    remote_kv_heads: int = 0  # P's model's kv heads (0: a TP 1 P that did not say)
    error: str = ""  # P's params could not be read: the load fails with this


@dataclass
class XferMeta(KVConnectorMetadata):
    sends: list = field(default_factory=list)  # [SendSpec]
    recvs: list = field(default_factory=list)  # [RecvSpec]
    # the step schedules no tokens: the worker may sleep (up to idle_wait_ms) for a
    # transfer to end instead of returning at once into the engine's next empty step
    idle: bool = False
    # the KV pool (kv_connector_extra_config.store; pool.py)
    # P: layer-by-layer streams to cancel (the request was aborted)
    cancels: list = field(default_factory=list)
    # P: wire ids of remote-decode requests whose prompt this step's forward completes
    prefill_ends: list = field(default_factory=list)
    pool_loads: list = field(default_factory=list)  # [PoolBlocks]: before this step's forward
    pool_puts: list = field(default_factory=list)  # [PoolBlocks]: after it
    pool_holds: list = field(default_factory=list)  # finished request ids whose blocks wait for their puts
    preempted: tuple = ()  # request ids preempted this step: their puts and sends must end before the forward


@dataclass
class XferHandshake(KVConnectorHandshakeMetadata):
    """A worker's kvxfer agent address (``host:port``), layout fingerprint, and the
    global kv heads ``[lo, hi)`` of ``num_kv_heads`` its rank holds."""

    address: str
    fingerprint: str
    tp_rank: int = 0
    tp_size: int = 1
    lo: int = 0
    hi: int = 0
    num_kv_heads: int = 0
