"""The state an agent's parts share, in one explicit object.

:class:`AgentState` is what the :class:`~kvxfer.control.sender.Sender`, the
:class:`~kvxfer.control.receiver.Receiver`, the connections and the backend
driver are built with: identity, configuration, the one lock, the backend, the
I/O loop, metrics, leases, the connected peers and the registered pool. Each
part keeps its own book-keeping (sends, recvs, grants) to itself; what they
share lives here and nowhere else.

Lock order: ``AgentState.lock`` may be held while taking a handle's, a peer
connection's send lock or the I/O loop's lock, never the other way round.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from ..errors import KVXferError


@dataclass(eq=False)
class Pool:
    """What :meth:`~kvxfer.Agent.register_kv` registered (built by :mod:`.registration`).

    ``stage_in_t`` / ``stage_out_t``: uint8 ``[staging_bytes]`` tensors on the pool's
    device, D's landing ring and P's packing buffer; ``stage_in`` / ``stage_out`` their
    allocators; ``*_region`` their first region id.
    """

    layout: object  # kvxfer.KVLayout
    geometry: object  # kvxfer.transport.descriptors.Geometry
    region_ids: list  # per region of the layout, its first part's id
    registered: list  # every part of every region and staging buffer
    parts: dict  # regions registered in several parts (kvxfer/control/parts.py)
    stage_in_t: object
    stage_out_t: object
    stage_in_region: int
    stage_out_region: int
    stage_in: object = None  # kvxfer.control.staging.StagingRing
    stage_out: object = None


@dataclass(eq=False)
class AgentState:
    """Shared by every part of one agent (see module doc)."""

    name: str
    agent_id: str
    config: object  # kvxfer.config.AgentConfig
    backend: object  # kvxfer.transport.base.Backend
    metrics: object  # kvxfer.metrics.Metrics
    leases: object  # kvxfer.lease.LeaseTable
    cost: object  # kvxfer.transport.paths.CostModel
    device: object = None  # kvxfer.kernels.device.Device; the pool's unless given
    loop: object = None  # kvxfer.control.loop.IOLoop, set once it runs
    pool: Pool | None = None
    peers: dict = field(default_factory=dict)  # serial -> Peer, connected and ready
    lock: threading.RLock = field(default_factory=threading.RLock)
    closed: bool = False

    @property
    def staging_bytes(self) -> int:
        return self.config.staging_bytes

    @property
    def layout(self):
        return None if self.pool is None else self.pool.layout

    @property
    def geometry(self):
        return None if self.pool is None else self.pool.geometry

    def check_open(self) -> None:
        if self.closed:
            raise KVXferError(f"agent {self.name!r} is closed")

    def check_ids(self, block_ids) -> tuple:
        """``block_ids`` (ints, sequence, array or tensor) as a tuple of in-range ids;
        KVXferError if closed or unregistered, ValueError if empty or out of range."""
        self.check_open()
        pool = self.pool
        if pool is None:
            raise KVXferError("call register_kv before moving blocks")
        if type(block_ids) in (list, tuple) and block_ids and set(map(type, block_ids)) == {int}:
            ids = tuple(block_ids)  # the common case, without a numpy round trip
        else:
            ids = tuple(int(b) for b in np.asarray(block_ids, dtype=np.int64).reshape(-1))
        if not ids:
            raise ValueError("block_ids is empty")
        num_blocks = pool.layout.num_blocks
        if min(ids) < 0 or max(ids) >= num_blocks:
            bad = [b for b in ids if not 0 <= b < num_blocks]
            raise ValueError(f"block id {bad[0]} out of range [0, {num_blocks})")
        return ids
