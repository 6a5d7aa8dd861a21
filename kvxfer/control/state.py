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
from ..runs import check_block_ids
from .wire import MAX_STR


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

    def registered(self) -> Pool:
        """The pool; KVXferError if the agent is closed or :meth:`register_kv` did not run."""
        self.check_open()
        pool = self.pool
        if pool is None:
            raise KVXferError("call register_kv before moving blocks")
        return pool

    def block_ids(self, block_ids, *, unique: bool = False, num_blocks: int | None = None) -> tuple:
        """``block_ids`` of this pool (or of a pool of ``num_blocks``: a peer's) as a
        non-empty tuple of Python ints, through the one validator
        (:func:`kvxfer.runs.check_block_ids`); KVXferError if closed or unregistered."""
        pool = self.registered()
        ids = check_block_ids(block_ids, pool.layout.num_blocks if num_blocks is None else num_blocks,
                              unique=unique)
        if isinstance(ids, np.ndarray):
            ids = tuple(ids.tolist())
        if not ids:
            raise ValueError("block_ids is empty")
        return ids


def request_id(value) -> str:
    """A request id as the wire carries it: a non-empty ``str`` of at most ``MAX_STR``
    characters that UTF-8 can encode. TypeError / ValueError (at the call: a peer's
    decoder would refuse anything else)."""
    if not isinstance(value, str):
        raise TypeError(f"request_id must be a str, got {type(value).__name__}")
    value = str(value)  # a subclass (numpy.str_) as the plain str the wire carries
    if not value:
        raise ValueError("request_id is empty")
    if len(value) > MAX_STR:
        raise ValueError(f"request_id has {len(value)} characters; at most {MAX_STR} are allowed")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("request_id is not encodable as UTF-8 (a lone surrogate)") from None
    return value
