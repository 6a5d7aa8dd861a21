"""Book-keeping records of in-flight transfers (guarded by the agent state's lock)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .pieces import Coverage


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

    peer: object
    key: tuple  # (peer serial, request id) in Sender.sends; (None, id) for send(None, ...)
    wire_req: str  # request id on the wire ("" for one-sided writes)
    ids: tuple  # P's block ids (after matching: only the ones shipped, ids[post.skip:])
    completer: object  # kvxfer.handle.HandleCompleter of the caller's handle
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
    started: float = field(default_factory=time.monotonic)
    after: list = field(default_factory=list)  # producer tokens (send(after=)) every piece waits for
    timer: object = None  # the loop's lease-expiry timer, cancelled once the lease is released

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
    completer: object  # kvxfer.handle.HandleCompleter of the caller's handle
    skip: int = 0  # the sender's first `skip` blocks are not moved (D holds them already)
    coverage: Coverage | None = None  # which (layer, head, block) cells landed
    posted_to: set = field(default_factory=set)  # peers holding our RECV_POST
    matched: set = field(default_factory=set)  # peers that said they will write
    quiescing: set = field(default_factory=set)  # peers that must CANCEL_ACK before blocks are free
    reason: str = "done"
    started: float = field(default_factory=time.monotonic)
    post_frame: bytes = b""  # the encoded RECV_POST (the same frame goes to every peer)
    unpacking: int = 0  # chunks the device may still be scattering into `blocks`
    timer: object = None  # the loop's lease-expiry timer, cancelled once the recv ended
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
