"""Everything mutable an agent's components share, in one explicit object.

:class:`AgentState` is what the :class:`~kvxfer.agent.sender.Sender`, the
:class:`~kvxfer.agent.receiver.Receiver`, the connections and the backend
driver are built with: identity, configuration, the one lock, the backend, the
I/O loop, metrics, leases, the connected peers and the registered pool. Each
component keeps its own book-keeping (sends, recvs, grants) to itself; what they
share lives here and nowhere else. The in-flight records (:class:`Post`,
:class:`SendOp`, :class:`RecvOp`) and a recv's landed cells (:class:`Coverage`)
live here too: the sender (with the shipper it owns) changes a SendOp, the receiver
a RecvOp, nothing else.

Lock order: ``AgentState.lock`` may be held while taking a handle's, a peer
connection's send lock or the I/O loop's lock, never the other way round.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import KVXferError
from ..runs import check_block_ids
from .protocol import MAX_STR

if TYPE_CHECKING:  # types only: these modules import this one, or are heavy
    import torch

    from ..config import AgentConfig
    from ..handle import HandleCompleter
    from ..kernels.device import Device
    from ..layout import KVLayout
    from ..lease import LeaseTable
    from ..metrics import Metrics
    from ..transport.base import Backend
    from ..transport.descriptors import Geometry
    from ..transport.paths import CostModel
    from .io_loop import IOLoop, Timer
    from .peers import Peer
    from .pool import StagingRing


@dataclass(eq=False)
class Pool:
    """What :meth:`~kvxfer.Agent.register_kv` registered (built by :func:`~kvxfer.agent.pool.register_pool`).

    ``stage_in_t`` / ``stage_out_t``: uint8 ``[staging_bytes]`` tensors on the pool's
    device, D's landing ring and P's packing buffer; ``stage_in`` / ``stage_out`` their
    allocators; ``*_region`` their first region id.
    """

    layout: KVLayout
    geometry: Geometry
    region_ids: list  # per region of the layout, its first part's id
    registered: list  # every part of every region and staging buffer
    parts: dict  # regions registered in several parts (see kvxfer/agent/pool.py)
    stage_in_t: torch.Tensor
    stage_out_t: torch.Tensor
    stage_in_region: int
    stage_out_region: int
    stage_in: StagingRing | None = None
    stage_out: StagingRing | None = None
    ipc: object = None  # maps same-node peers' pools (kvxfer.transport.cuda_peer), or None
    peer_offer: dict = field(default_factory=dict)  # what INFO offers same-node peers (cuda_peer.export_pool)


@dataclass(eq=False)
class AgentState:
    """Shared by every component of one agent (see module doc)."""

    name: str  # Agent.name
    agent_id: str  # a fresh uuid (hex) per agent, sent in INFO
    config: AgentConfig
    backend: Backend
    metrics: Metrics
    leases: LeaseTable  # every block lent to an in-flight transfer
    cost: CostModel  # picks zero-copy or pack per piece
    device: Device | None = None  # the pool's unless given
    loop: IOLoop | None = None  # set once it runs
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


@dataclass(frozen=True)
class Post:
    """D's RECV_POST as P sees it: where request ``req`` goes."""

    req: str
    xid: int  # D's id of this recv, so stale messages for a re-used request id are ignored
    blocks: tuple
    layers: tuple
    heads: tuple  # D's global (start, stop)
    skip: int = 0  # D already holds the sender's first `skip` blocks; `blocks` takes the rest


@dataclass(eq=False)
class SendOp:
    """P side of a send, streaming send, or one-sided write."""

    peer: Peer | None  # None until a send(None, ...) is matched
    key: tuple  # (peer serial, request id) in Sender.sends; (None, id) for send(None, ...)
    wire_req: str  # request id on the wire ("" for one-sided writes)
    ids: tuple  # P's block ids (after matching: only the ones shipped, ids[post.skip:])
    completer: HandleCompleter  # of the caller's handle
    ready: list | None  # layers the caller released for shipping; None: all D asks for
    streaming: bool = False
    notify: bytes | None = None
    post: Post | None = None
    target: frozenset = frozenset()  # layers that must be visible on D for completion
    shipped: set = field(default_factory=set)
    pending: dict = field(default_factory=dict)  # layer -> chunks not yet visible
    visible: set = field(default_factory=set)
    inflight: int = 0  # worker jobs running for this op
    ended: str | None = None  # lease reason once the op stopped early
    ack_owed: bool = False  # D asked to cancel; answer once quiet
    told: bytes | None = None  # the CANCEL/FAIL for D, held until no job of this op still writes
    acks_only: bool = False  # its lease lapsed with every piece written: only D's unpack ACKs were awaited
    started: float = field(default_factory=time.monotonic)
    after: list = field(default_factory=list)  # producer tokens (send(after=)) every piece waits for
    timer: Timer | None = None  # the loop's lease-expiry timer, cancelled once the lease is released

    @property
    def handle(self):
        return self.completer.handle


@dataclass(eq=False)
class RecvOp:
    """D side of a recv: which (layer, head) pieces have landed, who may still write."""

    req: str
    xid: int
    blocks: tuple
    layers: tuple
    heads: tuple  # this rank's global (start, stop)
    completer: HandleCompleter  # of the caller's handle
    skip: int = 0  # the sender's first `skip` blocks are not moved (D holds them already)
    coverage: Coverage | None = None  # which (layer, head, block) cells landed
    posted_to: set = field(default_factory=set)  # peers holding our RECV_POST
    matched: set = field(default_factory=set)  # peers that said they will write
    quiescing: set = field(default_factory=set)  # peers that must CANCEL_ACK before blocks are free
    reason: str = "done"
    started: float = field(default_factory=time.monotonic)
    post_frame: bytes = b""  # the encoded RECV_POST (the same frame goes to every peer)
    unpacking: int = 0  # chunks the device may still be scattering into `blocks`
    error: KVXferError | None = None  # what the handle fails with once the blocks are released
    timer: Timer | None = None  # the loop's lease-expiry timer, cancelled once the recv ended
    bulk: bool = False  # more bytes than one thread copies inline: a sender's copy pool works on it

    @property
    def handle(self):
        return self.completer.handle

    def __post_init__(self) -> None:
        if self.coverage is None:
            self.coverage = Coverage(self.layers, self.heads[1] - self.heads[0], self.blocks)


def stop_timer(op) -> None:
    """``op`` (a :class:`SendOp` or :class:`RecvOp`) is final, lock held: cancel its lease
    timer now, so the timer drops what it holds instead of keeping it to the deadline."""
    if op.timer is not None:
        op.timer.cancel()
        op.timer = None


# ---- Coverage ------------------------------------------------------------------
# Which parts of one recv have landed: cells of (layer, kv head, block).
#
# A piece (one DATA_DONE) covers some layers, a head range and either every block
# of the request (zero-copy) or a slice of them (a pack chunk of a request larger
# than half the staging ring). A layer is done once every (head, block) cell of
# it landed; the recv is done once every requested layer is. The common pieces
# -- a whole layer or the whole request -- are counted without any array; only a
# partial piece allocates a ``bool [blocks, heads]`` grid for its layers.


class Coverage:
    """Landed cells of one recv: ``layers`` (tuple), ``num_heads`` local heads, ``blocks`` (distinct ids)."""

    def __init__(self, layers: tuple, num_heads: int, blocks: tuple) -> None:
        self.layers = frozenset(layers)
        self.num_heads = num_heads
        self.blocks = blocks
        self.done: set = set()  # layers whose every cell landed
        self._cells: dict = {}  # layer -> bool ndarray [len(blocks), num_heads] (partial layers only)
        self._index: dict | None = None  # block id -> position, built on the first partial piece

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.layers)

    def positions(self, blocks) -> np.ndarray | None:
        """Positions of ``blocks`` in the request (int64 ``[n]``); None if one is not part of it
        or appears twice."""
        if self._index is None:
            self._index = {b: i for i, b in enumerate(self.blocks)}
        index = self._index
        pos = [index.get(b, -1) for b in blocks]
        if not pos or min(pos) < 0 or len(set(pos)) != len(pos):
            return None
        return np.asarray(pos, dtype=np.int64)

    def add(self, layers, lo: int, hi: int, pos: np.ndarray | None) -> list:
        """Mark local heads ``[lo, hi)`` of blocks ``pos`` (None: every block) in ``layers``;
        return the layers that became complete."""
        landed = []
        whole = pos is None or len(pos) == len(self.blocks)
        for layer in layers:
            if layer in self.done or layer not in self.layers:
                continue
            cells = self._cells.get(layer)
            if cells is None and whole and lo == 0 and hi == self.num_heads:
                self.done.add(layer)
                landed.append(layer)
                continue
            if cells is None:
                cells = self._cells[layer] = np.zeros((len(self.blocks), self.num_heads), dtype=bool)
            if pos is None:
                cells[:, lo:hi] = True
            else:
                cells[pos, lo:hi] = True
            if cells.all():
                del self._cells[layer]
                self.done.add(layer)
                landed.append(layer)
        return landed

    def heads_landed(self, lo: int, hi: int) -> bool:
        """True if local heads ``[lo, hi)`` of every block of every layer landed."""
        if hi <= lo:
            return True
        for layer in self.layers:
            if layer in self.done:
                continue
            cells = self._cells.get(layer)
            if cells is None or not cells[:, lo:hi].all():
                return False
        return True
