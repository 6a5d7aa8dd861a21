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
    to whichever D posts a recv for it."""

    request_id: str
    block_ids: tuple


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


@dataclass
class XferMeta(KVConnectorMetadata):
    sends: list = field(default_factory=list)  # [SendSpec]
    recvs: list = field(default_factory=list)  # [RecvSpec]
    # the step schedules no tokens: the worker may sleep (up to idle_wait_ms) for a
    # transfer to end instead of returning at once into the engine's next empty step
    idle: bool = False
    # the KV pool (kv_connector_extra_config.store; vllm_pool.py)
    pool_loads: list = field(default_factory=list)  # [PoolBlocks]: before this step's forward
    pool_puts: list = field(default_factory=list)  # [PoolBlocks]: after it
    pool_holds: list = field(default_factory=list)  # finished request ids whose blocks wait for their puts
    preempted: tuple = ()  # request ids preempted this step: their puts must end before the forward


@dataclass
class XferHandshake(KVConnectorHandshakeMetadata):
    """A worker's kvxfer agent address (``host:port``) and layout fingerprint."""

    address: str
    fingerprint: str
