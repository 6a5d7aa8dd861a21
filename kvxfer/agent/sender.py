"""The P (prefill) side of an agent: send, send_layer, write, read.

A send is matched with D's RECV_POST (either may come first, :class:`PostMatcher`),
then shipped in pieces (all layers, or one layer per :meth:`Sender.send_layer`)
by the :class:`~kvxfer.agent.datapath.Shipper`. Each piece gets its path, is moved zero-copy or
packed through the staging buffers, and reported to D with DATA_DONE only after
the backend completed (data visible). The op completes when every layer D asked
for is visible: zero-copy at write completion, pack when D ACKs the unpack.

The :class:`Sender` owns its sends (``sends``). The shipper reports a piece back
through three methods only, :meth:`Sender.visible` (its layers are visible on D),
:meth:`Sender.failed` and :meth:`Sender.finished` (its job ended, however it
ended), and never reads ``sends``; the post matcher (this module's other half of the
P side) looks ops up in ``sends``, and nothing outside this module touches them.


:class:`PostMatcher` holds D's RECV_POSTs as this agent sees them, and D's cancels.
A RECV_POST is checked (:func:`check_post`), then matched with a waiting send or
cached (bounded per peer, :class:`~kvxfer.agent.peers.PeerBook`). A post we cannot
serve fails D's recv with a typed FAIL. When D ends a recv before we sent it, a
tombstone remembers why: a later send of that id waits :data:`TOMBSTONE_GRACE_S`
for a new post (the id reused) before it fails.
"""
from __future__ import annotations

import itertools
import time

from ..errors import (InvalidDescriptor, KVXferError, LayoutMismatch, PeerDisconnected, ProtocolError,
                      TransferCancelled, TransferTimeout)
from ..handle import HandleCompleter
from ..timeouts import check_timeout
from .datapath import Shipper
from .protocol import CODES, Msg, code_of, distinct_below, encode, error_from
from .state import AgentState, Post, SendOp, request_id as request_id_of, stop_timer


class Sender:
    def __init__(self, state: AgentState) -> None:
        self._s = state
        self.sends: dict[tuple, SendOp] = {}  # (peer serial | None, request id) -> op
        self._wids = itertools.count(1)
        self.reads: set = set()  # completers of one-sided reads still running
        self.posts = PostMatcher(state, self)
        self.shipper = Shipper(state, self)

    def handlers(self) -> dict:
        """``{Msg: fn(peer, fields)}`` of the messages D sends to a sender (CANCEL/FAIL with
        ``to_sender`` set go to ``self.posts.on_cancel``, :meth:`PostMatcher.on_cancel`)."""
        return {Msg.RECV_POST: self.posts.on_recv_post, Msg.STAGE_GRANT: self.shipper.on_stage_grant,
                Msg.ACK: self.shipper.on_ack}

    def outstanding(self) -> bool:
        """A send waits for its receiver or is moving (a hint: read without the lock)."""
        return bool(self.sends)

    def copying(self) -> bool:
        """The send worker has a job queued or running (a hint: read without the lock)."""
        return not self.shipper.worker.idle()

    # ---- public API (see Agent) -------------------------------------------------------
    def send(self, peer, request_id: str, block_ids, *, layers=None, lease_timeout=None, after=None):
        req = request_id_of(request_id)
        ids = self._s.block_ids(block_ids)
        lease_timeout = check_timeout(lease_timeout, "lease_timeout")
        ready = None if layers is None else list(self._s.registered().layout.resolve_layers(layers))
        token = self._s.device.capture(after)
        return self._start(peer, req, ids, ready, False, lease_timeout, token)

    def send_layer(self, peer, request_id: str, layer: int, block_ids, *, lease_timeout=None, after=None):
        req = request_id_of(request_id)
        ids = self._s.block_ids(block_ids)
        lease_timeout = check_timeout(lease_timeout, "lease_timeout")
        (layer,) = self._s.registered().layout.resolve_layers(layer)
        token = self._s.device.capture(after)
        with self._s.lock:
            self._s.check_open()
            op = self.sends.get((None if peer is None else peer.serial, req))
            if op is not None and op.streaming:
                if op.ids != ids[op.post.skip if op.post is not None else 0:]:
                    raise ValueError("send_layer: block_ids differ from the stream's first call")
                if layer in op.shipped or layer in op.ready:
                    raise ValueError(f"layer {layer} of {req!r} was already sent")
                op.ready.append(layer)
                if token is not None:
                    op.after.append(token)
                if op.post is not None and not op.handle.done():
                    self.shipper.ship(op, [layer])
                return op.handle
            return self._start(peer, req, ids, [layer], True, lease_timeout, token)

    def write(self, peer, local_ids, remote_ids, *, layers=None, notify: bytes | None = None):
        ids = self._s.block_ids(local_ids)
        remote = self._remote_ids(peer, remote_ids, len(ids), unique=True)
        lay = tuple(self._s.registered().layout.resolve_layers(layers))
        max_notify = self._s.config.limits.max_notify_bytes
        if notify is not None and len(notify) > max_notify:
            raise ValueError(f"notify payload of {len(notify)} B exceeds {max_notify} B")
        post = Post("", 0, remote, lay, peer.geometry.head_range)
        key = (peer.serial, f"#write-{next(self._wids)}")
        with self._s.lock:
            op = self._new_op(peer, key, "", ids, list(lay), False, None, "write")
            op.notify = None if notify is None else bytes(notify)
            self.match(op, post, send_matched=False)
        return op.handle

    def read(self, peer, local_ids, remote_ids, *, layers=None):
        ids = self._s.block_ids(local_ids, unique=True)
        remote = self._remote_ids(peer, remote_ids, len(ids), unique=False)
        lay = tuple(self._s.registered().layout.resolve_layers(layers))
        completer = HandleCompleter("read", "", peer.name, layers=lay)
        with self._s.lock:  # close() fails every read it finds here, so none is left pending
            self._s.check_open()
            self.reads.add(completer)
            completer.handle.add_done_callback(lambda h: self.reads.discard(completer))
            self.shipper.read(peer, completer, ids, remote, lay)
        return completer.handle

    def pending_recvs(self) -> list:
        return self.posts.pending_recvs()

    def _remote_ids(self, peer, remote_ids, n: int, *, unique: bool) -> tuple:
        """``remote_ids`` of ``peer``'s pool (the one validator; ``unique``: they are
        written), as many as the local ids."""
        if peer.geometry is None:
            raise LayoutMismatch(f"peer {peer.name!r} registered no KV pool")
        remote = self._s.block_ids(remote_ids, unique=unique, num_blocks=peer.geometry.num_blocks)
        if len(remote) != n:
            raise ValueError(f"remote_ids has {len(remote)} blocks, local_ids {n}")
        return remote

    # ---- op lifecycle ---------------------------------------------------------------
    def _new_op(self, peer, key, wire_req, ids, ready, streaming, lease_timeout, kind, token=None) -> SendOp:
        if peer is not None and not peer.is_connected:
            raise PeerDisconnected(f"peer {peer.name!r} is disconnected")
        completer = HandleCompleter(kind, wire_req or key[1], None if peer is None else peer.name,
                                    layers=ready if ready is not None and not streaming else ())
        op = SendOp(peer, key, wire_req, ids, completer, ready, streaming)
        if token is not None:  # before the op is published: a RECV_POST may match it at once
            op.after.append(token)
        completer.set_canceller(lambda h: self._cancel(op))
        with self._s.lock:
            self._s.check_open()  # under the lock: close() fails every op registered before it
            if key in self.sends:
                raise ValueError(f"request {key[1]!r} is already being sent to {peer.name!r}")
            lease = self._s.leases.acquire(("send",) + key, key[1], ids, lease_timeout)
            self.sends[key] = op
            op.timer = self._s.loop.call_later(lease.deadline - time.monotonic(), lambda: self._expire(op))
        return op

    def _start(self, peer, req, ids, ready, streaming, lease_timeout, token=None):
        # one hold of the lock from registration to match: close() either comes first (the
        # op is refused) or fails the op after this returns
        with self._s.lock:
            op = self._new_op(peer, (None if peer is None else peer.serial, req), req, ids, ready, streaming,
                              lease_timeout, "send", token)
            if peer is None:  # to whoever posted (or will post) this id
                key = self.posts.find(req)
                if key is None:
                    return op.handle
                self.bind(op, self._s.peers.get(key[0]))
                post = self.posts.take(key)
            else:
                post = self.posts.take(op.key)
            if post is not None:
                self.match(op, post)
            else:
                error = self.posts.unbury(peer, req)
                if error is not None:
                    self.posts.bury(op, error)
        return op.handle

    def on_malformed_post(self, peer, fields: dict, exc) -> None:
        """A RECV_POST of ``peer`` that did not decode (I/O thread): fail our send of the
        request it names, if one waits for it, and D's recv (FAIL); nothing else. One
        that names no request (its ``req`` or ``xid`` is the bad field) is only counted."""
        req, xid = fields.get("req"), fields.get("xid")
        if not req or xid is None:
            return
        error = ProtocolError(f"RECV_POST of {req!r} from {peer.name!r} is malformed: {exc}")
        with self._s.lock:
            op = self.sends.get((peer.serial, req))
            if op is not None and op.post is None and op.ended is None:
                op.post = Post(req, xid, (), (), (0, 0))
                self.failed(op, error, "failed")  # tells D
                return
        peer.send(encode(Msg.FAIL, req=req, xid=xid, to_sender=False, code="protocol", reason=str(error)[:200]))

    # ---- internal interface (PostMatcher, datapath.Shipper; lock held unless said) ---------------
    @staticmethod
    def bind(op: SendOp, peer) -> None:
        """A ``send(None, ...)`` learns its receiver."""
        op.peer = peer
        op.completer.set_peer(peer.name)

    def match(self, op: SendOp, post: Post, send_matched: bool = True) -> None:
        """Both halves known: validate, tell D, queue the pieces."""
        op.post = post  # from here on, a failure is also reported to D (not at its recv timeout)
        geo = op.peer.geometry
        if geo is None or post.skip + len(post.blocks) != len(op.ids) or not all(
                b < geo.num_blocks for b in post.blocks):
            self.failed(op, InvalidDescriptor(
                f"{op.key[1]!r}: receiver expects {post.skip} + {len(post.blocks)} blocks, "
                f"sender has {len(op.ids)}"), "failed")
            return
        if not op.streaming and op.ready is not None and not set(post.layers) <= set(op.ready):
            missing = sorted(set(post.layers) - set(op.ready))
            self.failed(op, InvalidDescriptor(
                f"{op.key[1]!r}: receiver asks for layers {missing[:8]} the sender does not send"), "failed")
            return
        if post.skip:
            op.ids = op.ids[post.skip:]
        matched = encode(Msg.MATCHED, req=post.req, xid=post.xid) if send_matched else None
        wanted = set(post.layers)
        op.target = frozenset(wanted if op.ready is None or op.streaming else wanted & set(op.ready))
        if op.ready is None:
            op.ready = list(post.layers)
        if op.streaming:
            op.completer.expect_layers(op.target)
        ship = [l for l in op.ready if l in wanted]
        if not op.target or op.streaming:
            if matched is not None:
                op.peer.send(matched)
            if not op.target:
                self._finish(op)
            for layer in ship:
                self.shipper.ship(op, [layer])
        else:
            self.shipper.ship(op, ship, matched)

    def visible(self, op: SendOp, layers) -> None:
        """Pieces of ``layers`` are visible on D (any thread; takes the lock). Datapath interface."""
        with self._s.lock:
            done = []
            pending = op.pending
            for layer in layers:
                n = pending[layer] - 1
                pending[layer] = n
                if n == 0:
                    done.append(layer)
            op.visible.update(done)
            op.completer.mark_layers(done)
            if op.ended is None and op.target <= op.visible:
                self._finish(op)

    def _finish(self, op: SendOp) -> None:
        """Every target layer visible."""
        if op.notify is not None:
            op.peer.send(encode(Msg.NOTIFY, data=op.notify))
        # book-keeping first: whoever wakes on the handle sees metrics and leases settled
        metrics = self._s.metrics
        if not op.handle.done():
            metrics.inc("transfers", kind=op.handle.kind, path=op.handle.path or "none")
            metrics.observe("transfer_seconds", time.monotonic() - op.started, kind=op.handle.kind)
        self.sends.pop(op.key, None)
        stop_timer(op)
        self._s.leases.release(("send",) + op.key, "done")
        op.completer.succeed()

    def failed(self, op: SendOp, error: KVXferError, reason: str) -> None:
        """End ``op`` with ``error`` and tell D (any thread; takes the lock). Datapath interface.
        D is told once no job of the op still writes (:meth:`quiesce`), so a CANCEL or FAIL
        from a sender always means it is quiet: D frees the blocks without a round trip."""
        with self._s.lock:
            if op.ended is not None or op.handle.state == "done":
                return
            op.ended = reason
            if op.post is not None and op.wire_req and op.peer.is_connected:
                code = code_of(error)
                op.told = (encode(Msg.CANCEL, req=op.post.req, xid=op.post.xid, to_sender=False)
                           if code is None else
                           encode(Msg.FAIL, req=op.post.req, xid=op.post.xid, to_sender=False, code=code,
                                  reason=str(error)[:200]))
            self.quiesce(op)
            if not op.handle.done():
                self._s.metrics.inc("failures", kind=op.handle.kind, error=type(error).__name__)
                op.completer.fail(error)

    def _cancel(self, op: SendOp) -> None:
        with self._s.lock:
            if op.ended is not None:
                return
            op.ended = "cancelled"
            if op.post is not None and op.wire_req and op.peer.is_connected:
                op.told = encode(Msg.CANCEL, req=op.post.req, xid=op.post.xid, to_sender=False)
            self.quiesce(op)

    def quiesce(self, op: SendOp) -> None:
        """Once no shipping job still reads the blocks or writes D's: tell D how the op
        ended, answer its cancel, release the lease."""
        if op.inflight > 0 or op.ended is None:
            return
        if self.sends.get(op.key) is op:
            del self.sends[op.key]
        stop_timer(op)
        if op.told is not None and not op.ack_owed:  # D ended it itself: its CANCEL_ACK says enough
            op.peer.send(op.told)
        op.told = None
        if op.ack_owed and op.post is not None:
            op.peer.send(encode(Msg.CANCEL_ACK, req=op.post.req, xid=op.post.xid))
            op.ack_owed = False
        self._s.leases.release(("send",) + op.key, op.ended)

    def finished(self, op: SendOp) -> None:
        """A shipping job for ``op`` ended, however it ended (any thread). Datapath interface."""
        with self._s.lock:
            op.inflight -= 1
            self.quiesce(op)

    def _expire(self, op: SendOp) -> None:
        """The lease ran out. Where every piece is written and only D's unpack ACKs are
        outstanding, they get :data:`ACK_GRACE_S` more (D may be done, and both sides should
        agree); the error then says precisely how far the transfer got."""
        with self._s.lock:
            if op.handle.done() or op.ended is not None:
                return
            written = op.post is not None and op.inflight == 0 and op.target and op.target <= op.shipped
            if written and not op.acks_only:
                op.acks_only = True
                op.timer = self._s.loop.call_later(ACK_GRACE_S, lambda: self._expire(op))
                return
        if op.acks_only:
            error = TransferTimeout(f"lease of {op.key[1]!r} expired after every piece was written; the receiver "
                                    f"did not acknowledge unpacking them within {ACK_GRACE_S:g} s more (it may hold "
                                    f"the KV)")
        else:
            error = TransferTimeout(f"lease of {op.key[1]!r} expired before the receiver had it")
        self.failed(op, error, "expired")

    # ---- peers and shutdown -------------------------------------------------------------
    def peer_lost(self, peer, err) -> None:
        with self._s.lock:
            ops = [op for op in self.sends.values() if op.peer is peer]
            self.posts.peer_lost(peer)
            self.shipper.peer_lost(peer, err)
        for op in ops:
            self.failed(op, err, "failed")

    def close(self, err) -> None:
        with self._s.lock:
            ops = list(self.sends.values())
            reads = list(self.reads)
            self.shipper.abort_waits(err)
        for op in ops:
            self.failed(op, err, "closed")
        for completer in reads:
            completer.fail(err)

    def stop(self) -> None:
        """End the send worker (after :meth:`close` and the staging rings closed)."""
        self.shipper.stop()


# ---- D's RECV_POSTs and cancels --------------------------------------------------
TOMBSTONE_GRACE_S = 5.0  # an unmatched send for a request id D ended waits this long for a new post
ACK_GRACE_S = 2.0  # past its lease, a send whose every piece is written waits this long for D's unpack ACKs


class PostMatcher:
    """The RECV_POSTs of connected peers that no send matched yet, owned by the
    :class:`~kvxfer.agent.sender.Sender` (guarded by the state's lock)."""

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
                self._sender.failed(op, error, "cancelled" if isinstance(error, TransferCancelled) else "failed")

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
                self._sender.failed(op, exc, "failed")  # tells D
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
        sender.failed(op, error, "failed" if "code" in f else "cancelled")
        with self._s.lock:
            if op.ack_owed and op.ended is not None:
                sender.quiesce(op)


def check_post(geometry, num_layers: int, f: dict) -> None:
    """A RECV_POST from the peer of ``geometry`` (its advertised pool); ``num_layers`` of ours.
    Raises InvalidDescriptor naming the first bad field."""
    if geometry is None:
        raise InvalidDescriptor("RECV_POST from a peer that registered no KV pool")
    if not f["req"]:
        raise InvalidDescriptor("RECV_POST with an empty request id")
    if not distinct_below(f["blocks"], geometry.num_blocks):
        raise InvalidDescriptor(f"RECV_POST blocks must be distinct and below {geometry.num_blocks}")
    if not distinct_below(f["layers"], min(num_layers, geometry.num_layers)):
        raise InvalidDescriptor(f"RECV_POST layers must be distinct and below {num_layers}")
    if tuple(f["heads"]) != geometry.head_range:
        raise InvalidDescriptor(f"RECV_POST heads {tuple(f['heads'])} are not the peer's {geometry.head_range}")
