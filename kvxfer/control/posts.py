"""P side: D's RECV_POSTs as this agent sees them, and D's cancels.

A RECV_POST is checked (:func:`~kvxfer.control.checks.check_post`), then matched
with a waiting send or cached (bounded per peer, :mod:`kvxfer.control.limits`).
A post we cannot serve fails D's recv with a typed FAIL. When D ends a recv
before we sent it, a tombstone remembers why: a later send of that id waits
:data:`TOMBSTONE_GRACE_S` for a new post (the id reused) before it fails.
"""
from __future__ import annotations

import time

from ..errors import InvalidDescriptor, KVXferError, ProtocolError, TransferCancelled
from .checks import CODES, check_post, code_of, error_from
from .messages import Msg, encode
from .ops import Post, SendOp
from .state import AgentState

TOMBSTONE_GRACE_S = 5.0  # an unmatched send for a request id D ended waits this long for a new post


class PostMatcher:
    """The RECV_POSTs of connected peers that no send matched yet, owned by the
    :class:`~kvxfer.control.sender.Sender` (guarded by the state's lock)."""

    def __init__(self, state: AgentState, sender) -> None:
        self._s = state
        self._sender = sender
        self._posts: dict[tuple, Post] = {}  # (peer serial, req) -> post

    def __len__(self) -> int:
        return len(self._posts)

    def pending_recvs(self) -> list:
        """``[(peer, request_id, num_blocks), ...]``: recvs connected peers posted that no
        send of ours matched yet (``num_blocks`` counts the sender's blocks, skipped ones too)."""
        with self._s.lock:
            peers = self._s.peers
            return [(peers[s], p.req, p.skip + len(p.blocks)) for (s, _), p in self._posts.items() if s in peers]

    def find(self, req: str):
        """The key of a cached post for ``req`` from any peer, or None (lock held)."""
        return next((k for k in self._posts if k[1] == req), None)

    def take(self, key):
        """Remove and return the cached post of ``key`` (lock held)."""
        post = self._posts.pop(key, None)
        peer = self._s.peers.get(key[0])
        if post is not None and peer is not None:
            peer.book.drop_post(key[1])
        return post

    def peer_lost(self, peer) -> None:
        for key in [k for k in self._posts if k[0] == peer.serial]:
            del self._posts[key]

    @staticmethod
    def unbury(peer, req: str) -> KVXferError | None:
        """Remove the tombstone of ``req`` from ``peer``'s book; the error a send of that id
        fails with, or None if there was none (lock held)."""
        tomb = peer.book.unbury(req)
        if tomb is None:
            return None
        _, code, reason = tomb
        return TransferCancelled(reason) if code is None else CODES.get(code, ProtocolError)(reason)

    def bury(self, op: SendOp, error: KVXferError) -> None:
        """D ended this request id before we matched it (lock held). The send may be a
        late one for that recv -- or the first of a new recv reusing the id, whose post
        is still on its way: give it :data:`TOMBSTONE_GRACE_S` to arrive, then fail."""
        def expire():
            if op.post is None:
                self._sender.fail(op, error, "cancelled" if isinstance(error, TransferCancelled) else "failed")

        lease = self._s.leases.get(("send",) + op.key)
        grace = TOMBSTONE_GRACE_S if lease is None else min(TOMBSTONE_GRACE_S, lease.deadline - time.monotonic())
        self._s.loop.call_later(grace, expire)

    def on_recv_post(self, peer, f) -> None:
        post = Post(f["req"], f["xid"], tuple(f["blocks"]), tuple(f["layers"]), f["heads"], f["skip"])
        key = (peer.serial, post.req)
        layout = self._s.layout
        try:
            check_post(peer.geometry, layout.num_layers if layout is not None
                       else peer.geometry.num_layers if peer.geometry is not None else 0, f)
        except InvalidDescriptor as exc:
            # without its traceback: its frames hold the decoded message (up to 2**20 block ids)
            return self._refuse(peer, key, post, exc.with_traceback(None))
        sends = self._sender.sends
        with self._s.lock:
            peer.book.unbury(post.req)
            op = sends.get(key)
            if op is not None and op.post is None and op.ended is None:
                self._sender.match(op, post)
                return
            op = sends.get((None, post.req))
            if op is not None and op.peer is None and op.ended is None:
                self._sender.bind(op, peer)
                self._sender.match(op, post)
                return
            for old in peer.book.add_post(post.req, len(post.blocks)):  # bounded: the oldest go
                self._posts.pop(old, None)
            self._posts[key] = post

    def _refuse(self, peer, key, post: Post, exc: KVXferError) -> None:
        """A RECV_POST we cannot serve: fail D's recv (and a send waiting for it) with ``exc``."""
        with self._s.lock:
            op = self._sender.sends.get(key)
            if op is not None and op.post is None and op.ended is None:
                op.post = post
                self._sender.fail(op, exc, "failed")  # tells D
                return
            peer.book.bury(post.req, post.xid, code_of(exc), str(exc))  # a later send fails the same way
        peer.send(encode(Msg.FAIL, req=post.req, xid=post.xid, to_sender=False, code=code_of(exc) or "protocol",
                         reason=str(exc)[:200]))

    def on_cancel(self, peer, f) -> None:
        """CANCEL or FAIL (typed, ``code``) from D for one of our sends (``to_sender``)."""
        key = (peer.serial, f["req"])
        sender = self._sender
        with self._s.lock:
            post = self._posts.get(key)
            if post is not None and post.xid == f["xid"]:
                self.take(key)
            op = sender.sends.get(key)
            if op is None:  # maybe a send(None, ...) this peer matched
                op = sender.sends.get((None, f["req"]))
                op = op if op is not None and op.peer is peer else None
            error = (error_from(f, f"receiver {peer.name!r}") if "code" in f  # FAIL: typed
                     else TransferCancelled(f"receiver cancelled {f['req']!r}"))
            if op is None or op.post is None:  # nothing written: answer now
                peer.send(encode(Msg.CANCEL_ACK, req=f["req"], xid=f["xid"]))
                if op is not None:
                    self.bury(op, error)  # unless a new post for this id comes first
                elif peer.book.buried_xid(f["req"]) != f["xid"]:  # keep a refused post's error
                    peer.book.bury(f["req"], f["xid"], code_of(error), str(error))
                return
            if op.post.xid != f["xid"]:
                peer.send(encode(Msg.CANCEL_ACK, req=f["req"], xid=f["xid"]))
                return
            op.ack_owed = True
        sender.fail(op, error, "failed" if "code" in f else "cancelled")
        with self._s.lock:
            if op.ack_owed and op.ended is not None:
                sender.quiesce(op)
