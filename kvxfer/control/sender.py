"""The P (prefill) side of an agent: send, send_layer, write, read.

A send is matched with D's RECV_POST (either may come first, :mod:`.posts`),
then shipped in pieces (all layers, or one layer per :meth:`Sender.send_layer`)
by the :class:`~.shipping.Shipper`. Each piece gets its path, is moved zero-copy or
packed through the staging buffers, and reported to D with DATA_DONE only after
the backend completed (data visible). The op completes when every layer D asked
for is visible: zero-copy at write completion, pack when D ACKs the unpack.

The :class:`Sender` owns its sends (``sends``); the shipper and the post matcher
reach them only through the methods below marked *internal interface*.
"""
from __future__ import annotations

import itertools
import time

from ..errors import (InvalidDescriptor, KVXferError, LayoutMismatch, PeerDisconnected, ProtocolError,
                      TransferTimeout)
from ..handle import HandleCompleter
from .checks import code_of
from .messages import Msg, encode
from .ops import Post, SendOp, stop_timer
from .posts import PostMatcher
from .shipping import Shipper
from ..timeouts import check_timeout
from .state import AgentState, request_id as request_id_of


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
        ``to_sender`` set go to :meth:`PostMatcher.on_cancel`)."""
        return {Msg.RECV_POST: self.posts.on_recv_post, Msg.STAGE_GRANT: self.shipper.on_stage_grant,
                Msg.ACK: self.shipper.on_ack}

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
                self.fail(op, error, "failed")  # tells D
                return
        peer.send(encode(Msg.FAIL, req=req, xid=xid, to_sender=False, code="protocol", reason=str(error)[:200]))

    # ---- internal interface (posts.py, shipping.py; lock held unless said) ---------------
    @staticmethod
    def bind(op: SendOp, peer) -> None:
        """A ``send(None, ...)`` learns its receiver."""
        op.peer = peer
        op.handle.peer = peer.name

    def match(self, op: SendOp, post: Post, send_matched: bool = True) -> None:
        """Both halves known: validate, tell D, queue the pieces."""
        op.post = post  # from here on, a failure is also reported to D (not at its recv timeout)
        geo = op.peer.geometry
        if geo is None or post.skip + len(post.blocks) != len(op.ids) or not all(
                b < geo.num_blocks for b in post.blocks):
            self.fail(op, InvalidDescriptor(
                f"{op.key[1]!r}: receiver expects {post.skip} + {len(post.blocks)} blocks, "
                f"sender has {len(op.ids)}"), "failed")
            return
        if not op.streaming and op.ready is not None and not set(post.layers) <= set(op.ready):
            missing = sorted(set(post.layers) - set(op.ready))
            self.fail(op, InvalidDescriptor(
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

    def pieces_visible(self, op: SendOp, layers) -> None:
        """Pieces of ``layers`` are visible on D (any thread; takes the lock)."""
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

    def fail(self, op: SendOp, error: KVXferError, reason: str) -> None:
        """End ``op`` with ``error`` and tell D (any thread; takes the lock)."""
        with self._s.lock:
            if op.ended is not None or op.handle.state == "done":
                return
            op.ended = reason
            if op.post is not None and op.wire_req and op.peer.is_connected:
                code = code_of(error)
                op.peer.send(encode(Msg.CANCEL, req=op.post.req, xid=op.post.xid, to_sender=False)
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
                op.peer.send(encode(Msg.CANCEL, req=op.post.req, xid=op.post.xid, to_sender=False))
            self.quiesce(op)

    def quiesce(self, op: SendOp) -> None:
        """Release the lease once no shipping job still reads the blocks."""
        if op.inflight > 0 or op.ended is None:
            return
        if self.sends.get(op.key) is op:
            del self.sends[op.key]
        stop_timer(op)
        if op.ack_owed and op.post is not None:
            op.peer.send(encode(Msg.CANCEL_ACK, req=op.post.req, xid=op.post.xid))
            op.ack_owed = False
        self._s.leases.release(("send",) + op.key, op.ended)

    def piece_done(self, op: SendOp) -> None:
        """A shipping job for ``op`` ended, however it ended (any thread)."""
        with self._s.lock:
            op.inflight -= 1
            self.quiesce(op)

    def _expire(self, op: SendOp) -> None:
        if not op.handle.done():
            self.fail(op, TransferTimeout(f"lease of {op.key[1]!r} expired before the receiver had it"),
                      "expired")

    # ---- peers and shutdown -------------------------------------------------------------
    def peer_lost(self, peer, err) -> None:
        with self._s.lock:
            ops = [op for op in self.sends.values() if op.peer is peer]
            self.posts.peer_lost(peer)
            self.shipper.peer_lost(peer, err)
        for op in ops:
            self.fail(op, err, "failed")

    def close(self, err) -> None:
        with self._s.lock:
            ops = list(self.sends.values())
            reads = list(self.reads)
            self.shipper.abort_waits(err)
        for op in ops:
            self.fail(op, err, "closed")
        for completer in reads:
            completer.fail(err)

    def stop(self) -> None:
        """End the send worker (after :meth:`close` and the staging rings closed)."""
        self.shipper.stop()
