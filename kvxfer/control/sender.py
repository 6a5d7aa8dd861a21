"""The P (prefill) side of an agent: send, send_layer, write, read.

A send is matched with D's RECV_POST (either may come first), then shipped by
the send worker in pieces (all layers, or one layer per :meth:`send_layer`).
Each piece is planned (:mod:`kvxfer.plan`), moved zero-copy or packed through
the staging buffers, and reported to D with DATA_DONE only after the backend
completed (data visible). The op completes when every layer D asked for is
visible: zero-copy at write completion, pack when D ACKs the unpack.
"""
from __future__ import annotations

import itertools
import time

import numpy as np

from ..errors import InvalidDescriptor, KVXferError, LayoutMismatch, PeerDisconnected, TransferTimeout
from ..handle import TransferHandle
from .checks import code_of
from .limits import MAX_NOTIFY_BYTES
from .messages import Msg, encode
from .ops import Post, SendOp
from .posts import PostMatcher
from .shipping import INLINE_BYTES, Shipper
from .staging import StagingRing


class SenderSide(Shipper, PostMatcher):
    def __init__(self) -> None:
        self._sends: dict[tuple, SendOp] = {}
        self._posts: dict[tuple, Post] = {}
        self._grant_waits: dict[int, _GrantWait] = {}
        self._acks: dict[int, tuple] = {}  # tag -> (op, layers)
        self._tags = itertools.count(1)
        self._wids = itertools.count(1)
        # requests a receiver ended before we sent them live in each peer's book (limits.py)

    def _init_staging(self, nbytes: int) -> None:
        self._stage_out = StagingRing(nbytes)
        self._stage_in = StagingRing(nbytes)

    # ---- public API -----------------------------------------------------------------
    def send(self, peer, request_id: str, block_ids, *, layers=None, lease_timeout: float | None = None,
             after=None):
        """Ship ``block_ids`` (this pool) of ``request_id`` to whichever blocks ``peer``'s
        recv names. ``layers``: None = every layer the receiver asks for. Async: returns a
        :class:`TransferHandle` done when the data is visible in the receiver's blocks.
        The blocks stay leased until then (or cancel / failure / lease expiry).

        ``peer=None``: whichever connected peer posts a recv for ``request_id`` first
        (before or after this call) receives it; ``handle.peer`` names it once matched.
        A receiver that holds a prefix already (``recv(..., skip_blocks=k)``) gets only
        ``block_ids[k:]``; the lease covers all of ``block_ids`` either way.

        ``after``: the producer of these blocks' KV on a CUDA pool, a ``torch.cuda.Event``
        or ``torch.cuda.Stream`` (an event is recorded on it now): nothing reads the pool
        before it completed (zero-copy: the host waits for it before posting; pack:
        kvxfer's stream waits for it on the GPU). None: the KV must already be written."""
        ids = self._check_ids(block_ids)
        token = self._device.capture(after)
        ready = None if layers is None else list(self._layout.resolve_layers(layers))
        return self._start_send(peer, str(request_id), ids, ready, False, lease_timeout, token)

    def send_layer(self, peer, request_id: str, layer: int, block_ids, *, lease_timeout: float | None = None,
                   after=None):
        """Stream one finished layer; the first call opens the stream. Every call returns the
        same handle, done once every layer the receiver asked for has landed. ``after``: as
        for :meth:`send`, the event (or stream) that writes this layer's KV."""
        ids = self._check_ids(block_ids)
        token = self._device.capture(after)
        (layer,) = self._layout.resolve_layers(layer)
        with self._lock:
            op = self._sends.get((peer.serial, str(request_id)))
            if op is not None and op.streaming:
                if op.ids != ids[op.post.skip if op.post is not None else 0:]:
                    raise ValueError("send_layer: block_ids differ from the stream's first call")
                if layer in op.shipped or layer in op.ready:
                    raise ValueError(f"layer {layer} of {request_id!r} was already sent")
                op.ready.append(layer)
                if token is not None:
                    op.after.append(token)
                if op.post is not None and not op.handle.done():
                    self._enqueue_ship(op, [layer])
                return op.handle
        return self._start_send(peer, str(request_id), ids, [layer], True, lease_timeout, token)

    def write(self, peer, local_ids, remote_ids, *, layers=None, notify: bytes | None = None):
        """One-sided: copy local blocks into the peer's ``remote_ids`` (all heads both hold).
        ``notify`` reaches ``peer.notifications()`` after the data is visible there."""
        ids = self._check_ids(local_ids)
        remote = tuple(int(b) for b in remote_ids)
        self._check_remote(peer, remote, len(ids))
        lay = tuple(self._layout.resolve_layers(layers))
        if notify is not None and len(notify) > MAX_NOTIFY_BYTES:
            raise ValueError(f"notify payload of {len(notify)} B exceeds {MAX_NOTIFY_BYTES} B")
        post = Post("", 0, remote, lay, peer.geometry.head_range)
        key = (peer.serial, f"#write-{next(self._wids)}")
        op = self._new_op(peer, key, "", ids, list(lay), False, None, "write")
        op.notify = None if notify is None else bytes(notify)
        with self._lock:
            self._match(op, post, send_matched=False)
        return op.handle

    def read(self, peer, local_ids, remote_ids, *, layers=None):
        """One-sided: copy the peer's ``remote_ids`` into local blocks (zero-copy descriptors)."""
        ids = self._check_ids(local_ids)
        remote = tuple(int(b) for b in remote_ids)
        self._check_remote(peer, remote, len(ids))
        lay = tuple(self._layout.resolve_layers(layers))
        handle = TransferHandle("read", "", peer.name, layers=lay)
        self._send_q.put(lambda: self._do_read(peer, handle, ids, remote, lay))
        return handle

    # ---- validation -----------------------------------------------------------------
    def _check_ids(self, block_ids) -> tuple:
        self._check_open()
        if self._layout is None:
            raise KVXferError("call register_kv before moving blocks")
        if type(block_ids) in (list, tuple) and block_ids and set(map(type, block_ids)) == {int}:
            ids = tuple(block_ids)  # the common case, without a numpy round trip
        else:
            ids = tuple(int(b) for b in np.asarray(block_ids, dtype=np.int64).reshape(-1))
        if not ids:
            raise ValueError("block_ids is empty")
        if min(ids) < 0 or max(ids) >= self._layout.num_blocks:
            bad = [b for b in ids if not 0 <= b < self._layout.num_blocks]
            raise ValueError(f"block id {bad[0]} out of range [0, {self._layout.num_blocks})")
        return ids

    @staticmethod
    def _check_remote(peer, remote: tuple, n: int) -> None:
        if peer.geometry is None:
            raise LayoutMismatch(f"peer {peer.name!r} registered no KV pool")
        if len(remote) != n or not all(0 <= b < peer.geometry.num_blocks for b in remote):
            raise ValueError("remote_ids must be as many as local_ids and inside the peer's pool")

    # ---- op lifecycle ---------------------------------------------------------------
    def _new_op(self, peer, key, wire_req, ids, ready, streaming, lease_timeout, kind, token=None) -> SendOp:
        if peer is not None and not peer.is_connected:
            raise PeerDisconnected(f"peer {peer.name!r} is disconnected")
        handle = TransferHandle(kind, wire_req or key[1], None if peer is None else peer.name,
                                layers=ready if ready is not None and not streaming else ())
        op = SendOp(peer, key, wire_req, ids, handle, ready, streaming)
        if token is not None:  # before the op is published: a RECV_POST may match it at once
            op.after.append(token)
        handle._on_cancel = lambda h: self._cancel_send(op)
        with self._lock:
            if key in self._sends:
                raise ValueError(f"request {key[1]!r} is already being sent to {peer.name!r}")
            lease = self.leases.acquire(("send",) + key, key[1], ids, lease_timeout)
            self._sends[key] = op
        self._loop.call_later(lease.deadline - time.monotonic(), lambda: self._expire_send(op))
        return op

    def _start_send(self, peer, req, ids, ready, streaming, lease_timeout, token=None):
        op = self._new_op(peer, (None if peer is None else peer.serial, req), req, ids, ready, streaming,
                          lease_timeout, "send", token)
        with self._lock:
            if peer is None:  # to whoever posted (or will post) this id
                key = next((k for k in self._posts if k[1] == req), None)
                if key is None:
                    return op.handle
                self._bind(op, self._peers.get(key[0]))
                post = self._take_post(key)
            else:
                post = self._take_post(op.key)
            if post is not None:
                self._match(op, post)
            else:
                tomb = peer.book.tombstones.pop(req, None)
                if tomb is not None:
                    self._bury(op, tomb[1])
        return op.handle

    @staticmethod
    def _bind(op: SendOp, peer) -> None:
        """A ``send(None, ...)`` learns its receiver (lock held)."""
        op.peer = peer
        op.handle.peer = peer.name

    def _match(self, op: SendOp, post: Post, send_matched: bool = True) -> None:
        """Both halves known (lock held): validate, tell D, queue the pieces."""
        op.post = post  # from here on, a failure is also reported to D (not at its recv timeout)
        geo = op.peer.geometry
        if geo is None or post.skip + len(post.blocks) != len(op.ids) or not all(
                b < geo.num_blocks for b in post.blocks):
            self._fail_send(op, InvalidDescriptor(
                f"{op.key[1]!r}: receiver expects {post.skip} + {len(post.blocks)} blocks, "
                f"sender has {len(op.ids)}"), "failed")
            return
        if not op.streaming and op.ready is not None and not set(post.layers) <= set(op.ready):
            missing = sorted(set(post.layers) - set(op.ready))
            self._fail_send(op, InvalidDescriptor(
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
            op.handle._layers = op.target
        ship = [l for l in op.ready if l in wanted]
        if not op.target or op.streaming:
            if matched is not None:
                op.peer.send(matched)
            if not op.target:
                self._finish_send(op)
            for layer in ship:
                self._enqueue_ship(op, [layer])
        else:
            self._enqueue_ship(op, ship, matched)

    def _enqueue_ship(self, op: SendOp, layers: list, matched: bytes | None = None) -> None:
        """Queue a piece for the send worker; a small zero-copy piece runs right here
        (lock held, no waiting on the peer), saving a thread hop on the latency path.
        ``matched``: the MATCHED frame to send first. Ahead of an inline piece it goes
        out with ``MSG_MORE``, so it shares a segment with the DATA_DONE that follows
        (one wake-up on D instead of two); it is in the kernel before the write starts,
        so D still learns who matched if this process dies mid-write."""
        op.shipped.update(layers)
        op.inflight += 1
        layers = tuple(layers)
        after = tuple(op.after)  # the producer events written so far cover this piece's layers
        try:
            choice = self._choose(op, layers)
        except KVXferError as exc:
            choice = exc
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            choice = InvalidDescriptor(f"cannot plan {op.key[1]!r}: {exc!r}")
        inline = not isinstance(choice, Exception) and choice[1] == "zero_copy" and choice[2] <= INLINE_BYTES
        inline = inline and all(self._device.query(t) for t in after)  # never wait with the lock held
        if matched is not None:
            op.peer.send(matched, more=inline)
        if inline:
            self._ship(op, layers, choice, after)
        else:
            self._send_q.put(lambda: self._ship(op, layers, choice, after))

    def _finish_send(self, op: SendOp) -> None:
        """Every target layer visible (lock held)."""
        if op.notify is not None:
            op.peer.send(encode(Msg.NOTIFY, data=op.notify))
        # book-keeping first: whoever wakes on the handle sees metrics and leases settled
        if not op.handle.done():
            self.metrics.inc("transfers", kind=op.handle.kind, path=op.handle.path or "none")
            self.metrics.observe("transfer_seconds", time.monotonic() - op.started, kind=op.handle.kind)
        self._sends.pop(op.key, None)
        self.leases.release(("send",) + op.key, "done")
        op.handle._succeed()

    def _fail_send(self, op: SendOp, error: KVXferError, reason: str) -> None:
        with self._lock:
            if op.ended is not None or op.handle.state == "done":
                return
            op.ended = reason
            if op.post is not None and op.wire_req and op.peer.is_connected:
                code = code_of(error)
                op.peer.send(encode(Msg.CANCEL, req=op.post.req, xid=op.post.xid, to_sender=False)
                             if code is None else
                             encode(Msg.FAIL, req=op.post.req, xid=op.post.xid, to_sender=False, code=code,
                                    reason=str(error)[:200]))
            self._quiesce(op)
            if not op.handle.done():
                self.metrics.inc("failures", kind=op.handle.kind, error=type(error).__name__)
                op.handle._fail(error)

    def _cancel_send(self, op: SendOp) -> None:
        with self._lock:
            if op.ended is not None:
                return
            op.ended = "cancelled"
            if op.post is not None and op.wire_req and op.peer.is_connected:
                op.peer.send(encode(Msg.CANCEL, req=op.post.req, xid=op.post.xid, to_sender=False))
            self._quiesce(op)

    def _quiesce(self, op: SendOp) -> None:
        """Release the lease once no worker job still reads the blocks (lock held)."""
        if op.inflight > 0 or op.ended is None:
            return
        if self._sends.get(op.key) is op:
            del self._sends[op.key]
        if op.ack_owed and op.post is not None:
            op.peer.send(encode(Msg.CANCEL_ACK, req=op.post.req, xid=op.post.xid))
            op.ack_owed = False
        self.leases.release(("send",) + op.key, op.ended)

    def _expire_send(self, op: SendOp) -> None:
        if not op.handle.done():
            self._fail_send(op, TransferTimeout(f"lease of {op.key[1]!r} expired before the receiver had it"),
                            "expired")

    # ---- messages from D (I/O thread; RECV_POST and CANCEL in posts.py) -----------------
    def _on_stage_grant(self, peer, f) -> None:
        with self._lock:
            wait = self._grant_waits.get(f["tag"])
            if wait is None or wait.peer is not peer:
                peer.send(encode(Msg.STAGE_RELEASE, tag=f["tag"]))  # we gave up on it
                return
            wait.region, wait.offset = f["region"], f["offset"]
        wait.event.set()

    def _on_ack(self, peer, f) -> None:
        with self._lock:
            entry = self._acks.pop(f["tag"], None)
        if entry is None or entry[0].peer is not peer:
            return
        self._pieces_visible(*entry)

    def _sender_peer_lost(self, peer, err) -> None:
        with self._lock:
            ops = [op for op in self._sends.values() if op.peer is peer]
            for key in [k for k in self._posts if k[0] == peer.serial]:
                del self._posts[key]
            for tag, wait in list(self._grant_waits.items()):
                if wait.peer is peer:
                    wait.error = err
                    wait.event.set()
            for tag in [t for t, (op, _) in self._acks.items() if op.peer is peer]:
                del self._acks[tag]
        for op in ops:
            self._fail_send(op, err, "failed")

    def _sender_close(self, err) -> None:
        with self._lock:
            ops = list(self._sends.values())
            for wait in self._grant_waits.values():
                wait.error = err
                wait.event.set()
        for op in ops:
            self._fail_send(op, err, "closed")

    _dispatch = {Msg.RECV_POST: PostMatcher._on_recv_post, Msg.STAGE_GRANT: _on_stage_grant, Msg.ACK: _on_ack,
                 Msg.CANCEL: PostMatcher._on_cancel, Msg.FAIL: PostMatcher._on_cancel}
