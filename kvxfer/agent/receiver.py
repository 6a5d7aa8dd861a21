"""The D (decode) side of an agent: recv, staging grants, unpack, completion.

``recv`` broadcasts a RECV_POST to every peer (and to peers that connect later);
whichever peer holds the matching send writes. Completion is tracked per layer
as a bitmask of this rank's kv heads, so several senders (P with tp=2 feeding
D with tp=1) each deliver their head range and the request completes when
every requested layer has all of this rank's heads.

After a recv fails or is cancelled, its blocks stay leased until every peer
that could still write into them confirmed (CANCEL_ACK) or disconnected: a
block is never handed back while a late write may land in it.


:class:`Notifications` (the D side of one-sided writes) keeps the ``notify``
payloads that arrived, until drained. :func:`check_piece` / :func:`check_chunk_shape`
check what a sender says about a piece against what this agent knows before any
of it is used.
"""
from __future__ import annotations

import collections
import itertools
import time

from ..errors import (InvalidDescriptor, KVXferError, PeerDisconnected, ProtocolError, TransferCancelled,
                      TransferTimeout)
from ..handle import HandleCompleter
from ..timeouts import check_timeout
from .datapath import INLINE_BYTES, unpack_chunk
from .protocol import Msg, code_of, distinct_below, encode, error_from
from .state import AgentState, RecvOp, request_id as request_id_of, stop_timer
from .threads import Worker


class Receiver:
    """Owns the recvs, the staging grants given to senders and the receive worker."""

    def __init__(self, state: AgentState) -> None:
        self._s = state
        self.recvs: dict[str, RecvOp] = {}
        self.quiet_wait: dict[tuple, RecvOp] = {}  # (req, xid) -> op waiting for CANCEL_ACKs
        self.grants: dict[tuple, tuple] = {}  # (peer serial, tag) -> (offset, nbytes)
        self._xids = itertools.count(1)
        self.worker = Worker(f"kvxfer-recv-{state.name}")

    def handlers(self) -> dict:
        """``{Msg: fn(peer, fields)}`` of the messages P sends to a receiver (CANCEL/FAIL
        without ``to_sender`` go to :meth:`on_sender_cancel`)."""
        return {Msg.MATCHED: self._on_matched, Msg.STAGE_REQ: self._on_stage_req,
                Msg.DATA_DONE: self._on_data_done, Msg.STAGE_RELEASE: self._on_stage_release,
                Msg.CANCEL_ACK: self._on_cancel_ack}

    def bulk_pending(self) -> bool:
        """A pending recv is large: a sender's copy threads may be working on it now."""
        return any(op.bulk for op in list(self.recvs.values()))

    def outstanding(self) -> bool:
        """A recv is pending (a hint: read without the lock)."""
        return bool(self.recvs)

    def copying(self) -> bool:
        """The receive worker has a job, or a pending recv is one a sender's copy pool
        moves (a hint: read without the lock)."""
        return not self.worker.idle() or self.bulk_pending()

    def busy(self) -> bool:
        """Something waits for a sender (the backend driver progresses faster then)."""
        return bool(self.recvs or self.grants or self.quiet_wait)

    # ---- public API -------------------------------------------------------------------
    def recv(self, request_id: str, block_ids, *, layers=None, timeout: float | None = None,
             skip_blocks: int = 0):
        """See :meth:`kvxfer.Agent.recv` (the public contract); validates, leases, posts."""
        req = request_id_of(request_id)
        ids = self._s.block_ids(block_ids, unique=True)
        timeout = check_timeout(timeout)
        if type(skip_blocks) is not int or skip_blocks < 0:
            raise ValueError(f"skip_blocks must be an int >= 0, got {skip_blocks!r}")
        pool = self._s.registered()
        lay = tuple(pool.layout.resolve_layers(layers))
        heads = pool.geometry.head_range
        with self._s.lock:
            # all of it under the lock: nothing that could end this op (a DATA_DONE, a
            # cancel, a disconnect, close()) runs before it is registered and its lease exists
            self._s.check_open()
            if req in self.recvs:
                raise ValueError(f"request {req!r} is already being received")
            xid = next(self._xids)
            frame = encode(Msg.RECV_POST, req=req, xid=xid, blocks=ids, layers=lay, heads=heads, skip=skip_blocks)
            # the lease before any post: BlocksBusy (another transfer holds a block) leaves no trace
            lease = self._s.leases.acquire(("recv", req, xid), req, ids, timeout, writes=True)
            completer = HandleCompleter("recv", req, None, layers=lay)
            op = RecvOp(req, xid, ids, lay, heads, completer, skip_blocks, post_frame=frame,
                        bulk=len(lay) * len(ids) * pool.layout.block_nbytes() > INLINE_BYTES)
            self.recvs[req] = op
            completer.set_canceller(lambda h: self._end_recv(op, None, "cancelled"))
            op.timer = self._s.loop.call_later(lease.deadline - time.monotonic(), lambda: self._end_recv(
                op, TransferTimeout(f"recv {req!r} timed out"), "expired"))
            for peer in list(self._s.peers.values()):
                self._post_to(peer, op)
        if not op.bulk:  # its reply comes within a poll window (config.loop_spin_s)
            self._s.loop.kick()
        return completer.handle

    # ---- posting ----------------------------------------------------------------------
    @staticmethod
    def _post(peer, frame: bytes) -> bool:
        """Send a RECV_POST to ``peer`` if it can take one; True if it now holds it."""
        if peer.geometry is None or not peer.is_connected:
            return False
        peer.send(frame)
        return True

    def _post_to(self, peer, op: RecvOp) -> None:
        if self._post(peer, op.post_frame):
            op.posted_to.add(peer)

    def post_pending(self, peer) -> None:
        for op in list(self.recvs.values()):
            self._post_to(peer, op)

    # ---- completion and failure ----------------------------------------------------------
    def _delivered(self, req: str, xid: int, layers, heads: tuple, nbytes: int, blocks=None) -> None:
        """One piece landed: ``layers`` x global ``heads`` x ``blocks`` (D's ids; None: every
        block of the request). Completes the recv once every cell it asked for landed."""
        self._s.metrics.inc("bytes_received", nbytes)
        if not req:
            return  # a one-sided write; nothing to track
        with self._s.lock:
            op = self.recvs.get(req)
            if op is None or op.xid != xid or op.handle.done():
                return
            lo = max(heads[0], op.heads[0]) - op.heads[0]
            hi = min(heads[1], op.heads[1]) - op.heads[0]
            if hi <= lo:
                return
            cov = op.coverage
            pos = None if blocks is None else cov.positions(blocks)
            if blocks is not None and pos is None:
                return
            op.completer.add_bytes(nbytes)
            landed = cov.add(layers, lo, hi, pos)
            if not cov.complete:
                op.completer.mark_layers(landed)
                return
            # book-keeping first: whoever wakes on the handle sees the lease gone
            del self.recvs[req]
            stop_timer(op)
            self._s.metrics.inc("transfers", kind="recv", path=op.handle.path or "none")
            self._s.metrics.observe("transfer_seconds", time.monotonic() - op.started, kind="recv")
            self._s.leases.release(("recv", req, xid), "done")
            op.completer.succeed()

    def _end_recv(self, op: RecvOp, error: KVXferError | None, reason: str, quiet=None) -> None:
        """Fail (or, with ``error=None``, cancel) a recv: tell every peer that may still
        write, and once all of them are quiet release the blocks, then fail the handle, so a
        failed recv's blocks are free when its ``wait()`` returns. ``quiet``: the sender that
        ended it (a sender's CANCEL/FAIL comes once it no longer writes: no answer needed)."""
        with self._s.lock:
            if self.recvs.get(op.req) is not op:
                return
            del self.recvs[op.req]
            stop_timer(op)
            op.reason = reason
            op.error = error
            op.quiescing = {p for p in op.posted_to if p.is_connected and p is not quiet}
            code = None if error is None else code_of(error)
            frame = (encode(Msg.CANCEL, req=op.req, xid=op.xid, to_sender=True) if code is None else
                     encode(Msg.FAIL, req=op.req, xid=op.xid, to_sender=True, code=code, reason=str(error)[:200]))
            for peer in op.quiescing:
                peer.send(frame)
            self.quiet_wait[(op.req, op.xid)] = op
            if error is not None and not op.handle.done():
                self._s.metrics.inc("failures", kind="recv", error=type(error).__name__)
            if op.quiescing:  # a peer that never answers is disconnected once a lease has passed
                op.timer = self._s.loop.call_later(self._s.config.lease_timeout, lambda: self._force_quiet(op))
            self._maybe_quiet(op)

    def _maybe_quiet(self, op: RecvOp) -> None:
        if not op.quiescing and not op.unpacking and self.quiet_wait.pop((op.req, op.xid), None) is op:
            stop_timer(op)
            self._s.leases.release(("recv", op.req, op.xid), op.reason)
            if op.error is not None:
                op.completer.fail(op.error)

    def _force_quiet(self, op: RecvOp) -> None:
        """Peers that did not confirm a lease after the recv ended: disconnect them (their
        pending writes into these blocks end with the connection)."""
        with self._s.lock:
            if self.quiet_wait.get((op.req, op.xid)) is not op:
                return
            stuck = list(op.quiescing)
        for peer in stuck:
            self._s.loop.close_conn(peer.conn, TransferTimeout(
                f"no answer to the end of {op.req!r} within {self._s.config.lease_timeout:g} s"))

    # ---- messages from P (I/O thread) -----------------------------------------------------
    def _on_matched(self, peer, f) -> None:
        with self._s.lock:
            op = self.recvs.get(f["req"])
            if op is not None and op.xid == f["xid"]:
                op.matched.add(peer)
                op.completer.set_peer(peer.name)

    def _on_stage_req(self, peer, f) -> None:
        if self._s.layout is None or f["nbytes"] > self._s.staging_bytes // 2 or f["nbytes"] == 0:
            raise ProtocolError(f"STAGE_REQ of {f['nbytes']} bytes cannot be granted")
        tag = f["tag"]
        with self._s.lock:
            peer.book.add_stage_req()  # LimitExceeded closes this peer only

        def granted(offset: int) -> None:
            with self._s.lock:
                if not peer.is_connected or self._s.closed:
                    self._s.pool.stage_in.free(offset)
                    return
                self.grants[(peer.serial, tag)] = (offset, f["nbytes"])
            peer.send(encode(Msg.STAGE_GRANT, tag=tag, region=self._s.pool.stage_in_region, offset=offset))

        self._s.pool.stage_in.alloc_async(f["nbytes"], granted)

    def _take_grant(self, peer, tag):
        """Remove and return the grant ``(offset, nbytes)`` of ``tag`` (None if there is none)."""
        with self._s.lock:
            grant = self.grants.pop((peer.serial, tag), None)
            if grant is not None:
                peer.book.end_stage_req()
        return grant

    def _on_stage_release(self, peer, f) -> None:
        grant = self._take_grant(peer, f["tag"])
        if grant is not None:
            self._s.pool.stage_in.free(grant[0])

    def _on_data_done(self, peer, f) -> None:
        """P says a piece is written. Checked against our own request before it counts:
        a piece that does not fit fails that request on both sides; a staging grant is
        freed on every path."""
        grant = None
        if f["pack"]:
            grant = self._take_grant(peer, f["tag"])
            if grant is None or grant != (f["offset"], f["nbytes"]):
                if grant is not None:
                    self._s.pool.stage_in.free(grant[0])
                raise ProtocolError("DATA_DONE names staging space that was not granted")
        req, error, op = f["req"], None, None
        with self._s.lock:
            if req:
                op = self.recvs.get(req)
                if op is None or op.xid != f["xid"] or op.handle.done():
                    op = None  # stale: a recv that ended (its blocks are kept until P is quiet)
                else:
                    try:
                        check_piece(op, self._s.layout, peer, f)
                        op.completer.set_path("pack" if f["pack"] else "zero_copy", keep=True)
                    except KVXferError as exc:
                        error = exc
        if req and op is None or error is not None:
            if grant is not None:
                self._release_chunk(peer, f)
            if error is not None:
                self._end_recv(op, error, "failed")
            return
        if not f["pack"]:
            return self._delivered(req, f["xid"], f["layers"], f["heads"], f["nbytes"])
        if not req:  # a one-sided write's chunk: inside our pool?
            try:
                check_chunk_shape(self._s.layout, f)
            except InvalidDescriptor as exc:
                self._s.pool.stage_in.free(grant[0])
                raise ProtocolError(f"one-sided pack chunk: {exc}") from None
        self.worker.submit(lambda: self._unpack(peer, f))

    def _release_chunk(self, peer, f) -> None:
        """Free a chunk's staging slice unread and ACK it (P stops waiting for it)."""
        self._s.pool.stage_in.free(f["offset"])
        peer.send(encode(Msg.ACK, tag=f["tag"]))

    def _unpack(self, peer, f) -> None:
        """Receive worker: scatter one staged chunk; only once the device finished it (its
        token completed) free the slice, ACK and account, so neither the next write into
        the slice nor a completed recv can overtake the scatter."""
        off, nbytes = f["offset"], f["nbytes"]
        req, live, op, error = f["req"], True, None, None
        if req:
            with self._s.lock:
                op = self.recvs.get(req)
                live = op is not None and op.xid == f["xid"] and not op.handle.done()
                if live:
                    op.unpacking += 1  # its blocks are not released while the scatter may write them
        try:
            if live:
                unpack_chunk(self._s, f)
        except TransferTimeout as exc:  # the device never finished: the slice stays taken
            self._unpacked(op if live else None)
            self._s.loop.close_conn(peer.conn, exc)
            return
        except Exception as exc:  # noqa: BLE001 - checked before; a failure fails this request only
            error = InvalidDescriptor(f"cannot unpack a chunk of {req!r}: {exc!r}")
        self._s.pool.stage_in.free(off)
        peer.send(encode(Msg.ACK, tag=f["tag"]))
        if error is not None:
            self._unpacked(op if live else None)
            if op is not None:
                self._end_recv(op, error, "failed")
            return
        if live:
            self._delivered(req, f["xid"], f["layers"], f["heads"], nbytes, f["blocks"])
        self._unpacked(op if live else None)

    def _unpacked(self, op) -> None:
        if op is None:
            return
        with self._s.lock:
            op.unpacking -= 1
            if (op.req, op.xid) in self.quiet_wait:
                self._maybe_quiet(op)

    def on_malformed(self, peer, fields: dict, exc) -> None:
        """A MATCHED or DATA_DONE of ``peer`` that did not decode (I/O thread): free the
        staging grant it names, fail our recv of the request it names (which tells the
        senders); nothing else."""
        if "tag" in fields:
            grant = self._take_grant(peer, fields["tag"])
            if grant is not None:
                self._s.pool.stage_in.free(grant[0])
                peer.send(encode(Msg.ACK, tag=fields["tag"]))
        req, xid = fields.get("req"), fields.get("xid")
        with self._s.lock:
            op = self.recvs.get(req) if req else None
        if op is not None and op.xid == xid and peer in op.posted_to:
            self._end_recv(op, ProtocolError(f"{exc.kind.name} of {req!r} from {peer.name!r} is malformed: {exc}"),
                           "failed")

    def on_sender_cancel(self, peer, f) -> None:
        """CANCEL or FAIL (typed, ``code``) from a sender of one of our recvs."""
        with self._s.lock:
            op = self.recvs.get(f["req"])
        if op is not None and op.xid == f["xid"] and peer in op.posted_to:
            if "code" in f:
                self._end_recv(op, error_from(f, f"sender {peer.name!r}"), "failed", quiet=peer)
            else:
                self._end_recv(op, TransferCancelled(f"sender {peer.name!r} cancelled {f['req']!r}"), "cancelled",
                               quiet=peer)

    def _on_cancel_ack(self, peer, f) -> None:
        with self._s.lock:
            op = self.quiet_wait.get((f["req"], f["xid"]))
            if op is not None:
                op.quiescing.discard(peer)
                self._maybe_quiet(op)

    def peer_lost(self, peer, err: PeerDisconnected) -> None:
        with self._s.lock:
            for key in [k for k in self.grants if k[0] == peer.serial]:
                self._s.pool.stage_in.free(self.grants.pop(key)[0])
            failed = [op for op in self.recvs.values()
                      if peer in op.matched and not self._part_landed(op, peer)]
            for op in self.recvs.values():
                op.posted_to.discard(peer)
            for op in list(self.quiet_wait.values()):
                op.quiescing.discard(peer)
                self._maybe_quiet(op)
        for op in failed:
            self._end_recv(op, err, "failed")

    @staticmethod
    def _part_landed(op: RecvOp, peer) -> bool:
        """True if every head ``peer`` holds for ``op`` already landed (its share is done)."""
        lo = max(peer.geometry.head_range[0], op.heads[0]) - op.heads[0]
        hi = min(peer.geometry.head_range[1], op.heads[1]) - op.heads[0]
        return op.coverage.heads_landed(max(lo, 0), hi)

    def close(self, err: KVXferError) -> None:
        """Fail every recv, also those still waiting for their writers (the agent is
        closing: its backend ends every endpoint before a lease is released)."""
        with self._s.lock:
            ops = list(self.recvs.values())
        for op in ops:
            self._end_recv(op, err, "closed")
        with self._s.lock:
            waiting = list(self.quiet_wait.values())
            self.quiet_wait.clear()
        for op in waiting:
            stop_timer(op)
            if op.error is not None:
                op.completer.fail(op.error)

    def stop(self) -> None:
        """End the receive worker (after :meth:`close` and the staging rings closed)."""
        self.worker.stop()


# ---- notifications --------------------------------------------------------------
class Notifications:
    """NOTIFY messages received, in order; undrained ones count against their peer's limits."""

    def __init__(self, state: AgentState) -> None:
        self._s = state
        self._queue: collections.deque = collections.deque()

    def handlers(self) -> dict:
        return {Msg.NOTIFY: self._on_notify}

    def _on_notify(self, peer, f: dict) -> None:
        with self._s.lock:
            peer.book.add_note(len(f["data"]))  # LimitExceeded closes this peer only
            self._queue.append((peer, f["data"]))
        self._s.metrics.inc("notifications")

    def drain(self) -> list:
        """``[(peer, bytes), ...]`` received since the last call, in order."""
        with self._s.lock:
            out = list(self._queue)
            self._queue.clear()
            for peer, data in out:
                peer.book.drain_note(len(data))
        return out

    def clear(self) -> None:
        self._queue.clear()


# ---- checks of a sender's pieces ------------------------------------------------
def check_piece(op, layout, peer, f: dict):
    """A DATA_DONE for recv ``op`` from ``peer``, against what ``op`` asked for.

    Returns the positions of its blocks in the request (None: all of them, the
    zero-copy case). Raises ProtocolError (wrong peer) or InvalidDescriptor.
    """
    if peer not in op.matched:
        raise ProtocolError(f"DATA_DONE for {op.req!r} from {peer.name!r}, which never matched it")
    layers, heads = f["layers"], tuple(f["heads"])
    distinct = set(layers)
    if not layers or len(distinct) != len(layers) or not distinct <= op.coverage.layers:
        raise InvalidDescriptor(f"DATA_DONE layers {layers[:8]} are not part of {op.req!r}")
    theirs = peer.geometry.head_range if peer.geometry is not None else (0, 0)
    if not (max(op.heads[0], theirs[0]) <= heads[0] < heads[1] <= min(op.heads[1], theirs[1])):
        raise InvalidDescriptor(f"DATA_DONE heads {heads} outside {op.heads} and the sender's {theirs}")
    if f["pack"]:
        pos = op.coverage.positions(f["blocks"])
        if pos is None:
            raise InvalidDescriptor(f"DATA_DONE names blocks that are not (distinct) blocks of {op.req!r}")
        nblocks = len(pos)
    else:
        if f["blocks"]:
            raise InvalidDescriptor("a zero-copy DATA_DONE covers the whole request and names no blocks")
        pos, nblocks = None, len(op.blocks)
    # = layout.wire_nbytes(nblocks, layers, heads): the layers are distinct layers of op,
    # i.e. already resolved against this layout, so they need no second resolution
    if len(layers) * nblocks * layout.block_nbytes(heads) != f["nbytes"]:
        raise InvalidDescriptor(f"DATA_DONE of {f['nbytes']} B does not match its blocks, layers and heads")
    return pos


def check_chunk_shape(layout, f: dict) -> None:
    """A pack chunk with no request (one-sided write): inside this pool, sized right."""
    blocks, layers, heads = f["blocks"], f["layers"], tuple(f["heads"])
    own = layout.head_range
    if (not distinct_below(blocks, layout.num_blocks) or not distinct_below(layers, layout.num_layers)
            or not own[0] <= heads[0] < heads[1] <= own[1]
            or layout.wire_nbytes(len(blocks), layers, heads) != f["nbytes"]):
        raise InvalidDescriptor("pack chunk outside this pool or of the wrong size")
