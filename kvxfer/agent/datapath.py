"""Where the bytes move: the only agent module that calls ``backend.post``/``wait``
and ``device.pack``/``unpack``.

P side, :class:`Shipper` (the send worker's half): choose a piece's path, move it,
report it to the :class:`~kvxfer.agent.sender.Sender` through ``visible(op,
layers)``, ``failed(op, exc, reason)`` and ``finished(op)`` only. D side,
:func:`unpack_chunk`: scatter one staged chunk (the receive worker calls it).

A piece is a set of layers of one send (all of them, or one per ``send_layer``).
:meth:`Shipper._choose` asks the cost model for the path; zero-copy posts the
coalesced descriptors straight into D's pool, pack gathers into P's staging
buffer in chunks, writes each into a slice of D's staging ring that D granted,
and D scatters it. DATA_DONE goes out only after the backend completed, so D
never sees a completion before the bytes.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

import numpy as np

from ..errors import (InvalidDescriptor, KVXferError, LayoutMismatch, ProtocolError, TransferCancelled,
                      TransferTimeout)
from ..transport.descriptors import count_runs, overlap, zero_copy_descs
from ..transport.paths import device_cost, pack_chunks
from .pool import split_descs
from .protocol import Msg, encode
from .state import AgentState, SendOp
from .threads import Worker


log = logging.getLogger("kvxfer")

INLINE_BYTES = 4 << 20  # zero-copy pieces up to this size are posted by the matching thread (see ship)
PACK_DEPTH = 2  # chunks of a pack piece in flight; each at most 1/PACK_DEPTH of the smaller staging buffer


class _GrantWait:
    def __init__(self, peer) -> None:
        self.peer = peer
        self.event = threading.Event()
        self.region = self.offset = -1
        self.error: KVXferError | None = None


class _Chunk:
    """One staged chunk of a pack piece: its layers and slice of the op's blocks, bytes,
    tag, D's grant, the local staging offset, the pack's device token, the write's request."""

    __slots__ = ("layers", "sl", "nbytes", "tag", "grant", "off", "packed", "req", "posted_at")

    def __init__(self, layers, sl, nbytes, tag, grant, off) -> None:
        self.layers, self.sl, self.nbytes, self.tag, self.grant, self.off = layers, sl, nbytes, tag, grant, off
        self.packed = self.req = None
        self.posted_at = 0.0


class Shipper:
    """Moves the pieces of the :class:`~kvxfer.agent.sender.Sender`'s ops; owns the send
    worker, the staging grants it waits for and the ACKs it expects."""

    def __init__(self, state: AgentState, sender) -> None:
        self._s = state
        self._sender = sender
        self._grant_waits: dict[int, _GrantWait] = {}
        self._acks: dict[int, tuple] = {}  # tag -> (op, layers)
        self._tags = itertools.count(1)
        self._choices: dict = {}  # see _choose
        self.worker = Worker(f"kvxfer-send-{state.name}")

    def stop(self) -> None:
        self.worker.stop()

    def ship(self, op: SendOp, layers: list, matched: bytes | None = None) -> None:
        """Queue a piece for the send worker; a small zero-copy piece runs right here
        (lock held), saving a thread hop on the latency path, but only where the
        backend's write completes by itself (``not backend.needs_progress``: the vm
        path, loopback). Where it completes only once the target answers
        (``ucx:tcp+am-rma``) it goes to the worker, so this thread -- often the I/O
        thread, which matched a RECV_POST -- never waits on a peer.
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
            choice = InvalidDescriptor(f"cannot choose a path for {op.key[1]!r}: {exc!r}")
        inline = not isinstance(choice, Exception) and choice[1] == "zero_copy" and choice[2] <= INLINE_BYTES
        inline = (inline and not self._s.backend.needs_progress(op.peer.bconn)  # completes in post
                  and all(self._s.device.query(t) for t in after))  # never wait with the lock held
        if matched is not None:
            op.peer.send(matched, more=inline)
        if inline:
            self._ship(op, layers, choice, after)
        else:
            self.worker.submit(lambda: self._ship(op, layers, choice, after))

    def _remaining(self, op: SendOp) -> float:
        lease = self._s.leases.get(("send",) + op.key)
        if lease is None or op.ended is not None:
            raise TransferCancelled(f"{op.key[1]!r} stopped")
        return max(0.0, lease.deadline - time.monotonic())

    def _choose(self, op: SendOp, layers: tuple) -> tuple:
        """``(heads, path, nbytes)`` of one piece: the head overlap and the cost model's pick
        (a pure function of the peer's geometry and the piece's shape: cached)."""
        key = (op.peer.geometry, op.peer.device_transport, len(op.ids), layers, op.post.heads)
        cache = self._choices
        choice = cache.get(key)
        if choice is None:
            choice = self._choose_uncached(op, layers)
            if len(cache) >= 256:
                cache.clear()
            cache[key] = choice
        return choice

    def _choose_uncached(self, op: SendOp, layers: tuple) -> tuple:
        heads = overlap(self._s.geometry.head_range, op.post.heads)
        if heads is None:
            raise LayoutMismatch(f"no kv heads in common: sender {self._s.geometry.head_range}, "
                                 f"receiver {op.post.heads}")
        nbytes = len(op.ids) * len(layers) * self._s.layout.block_nbytes(heads)
        if self._s.config.path != "auto":
            return heads, self._s.config.path, nbytes
        if op.peer.link.usable:  # both pools on mapped devices of one node: one launch
            return heads, "cuda_peer", nbytes
        num_descs = count_runs(self._s.geometry, op.peer.geometry, len(op.ids), layers, heads)
        cost = self._s.cost
        if self._s.layout.device.type == "cuda" and self._s.config.cost_model is None:
            cost = device_cost(cost, op.peer.device_transport)
        return heads, cost.choose(num_descs, nbytes), nbytes

    def _ship(self, op: SendOp, layers: tuple, choice, after: tuple = ()) -> None:
        try:
            if isinstance(choice, Exception):
                raise choice
            heads, path, nbytes = choice
            if path == "cuda_peer":
                pool = op.peer.link.pool(op.peer.geometry, self._s.layout)
                if pool is None:  # cannot be mapped (logged): this peer is on UCX from now on
                    heads, path, nbytes = self._choose_uncached(op, layers)
            op.completer.set_path(path)
            op.completer.add_bytes(nbytes)
            if path == "cuda_peer":
                self._ship_peer(op, layers, heads, nbytes, pool, after)
            elif path == "zero_copy":
                self._ship_zero_copy(op, layers, heads, nbytes, after)
            else:
                self._ship_pack(op, layers, heads, after)
        except KVXferError as exc:
            self._sender.failed(op, exc, "expired" if isinstance(exc, TransferTimeout) else "failed")
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            self._sender.failed(op, InvalidDescriptor(f"{op.key[1]!r}: {exc!r}"), "failed")
        except Exception as exc:  # noqa: BLE001 - a bug fails this request, never the worker
            log.exception("send worker: %r failed", op.handle)
            self._sender.failed(op, ProtocolError(f"{op.key[1]!r}: internal error {exc!r}"), "failed")
        finally:
            self._sender.finished(op)

    def _post_and_wait(self, op: SendOp, kind: str, descs) -> None:
        t0 = time.perf_counter()
        if self._s.pool.parts or op.peer.parts:
            descs = split_descs(descs, self._s.pool.parts, op.peer.parts)
        req = self._s.backend.post(op.peer.bconn, kind, descs)
        self._wait(req, self._remaining(op), op.key[1], f"{kind} to {op.peer.name!r}")
        self._s.metrics.observe("post_seconds", time.perf_counter() - t0)

    def _wait(self, req: int, timeout: float, request_id: str, what: str) -> None:
        """``backend.wait``, its timeout named by the agent's request id, not the backend's."""
        try:
            self._s.backend.wait(req, timeout)
        except TransferTimeout:
            raise TransferTimeout(f"{request_id!r}: {what} not complete within {timeout:.3g} s") from None

    def _ship_zero_copy(self, op: SendOp, layers: tuple, heads: tuple, nbytes: int, after: tuple = ()) -> None:
        t0 = time.perf_counter()
        descs = zero_copy_descs(self._s.geometry, op.ids, op.peer.geometry, op.post.blocks, layers,
                                heads, self._s.pool.region_ids, op.peer.region_ids)
        self._s.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="zero_copy")
        # ready before the write, so only the send is left between completion and D
        done_frame = encode(Msg.DATA_DONE, req=op.wire_req, xid=op.post.xid, tag=0, pack=False,
                            blocks=[], layers=layers, heads=heads, offset=0, nbytes=nbytes)
        # the network reads the pool directly: the producer must have finished writing it
        self._s.device.wait(after, self._remaining(op))
        self._remaining(op)  # stop here if cancelled meanwhile
        self._post_and_wait(op, "write", descs)
        self._written(op, layers, done_frame)
        self._s.metrics.inc("bytes_sent", nbytes, path="zero_copy")

    def _ship_peer(self, op: SendOp, layers: tuple, heads: tuple, nbytes: int, pool, after: tuple = ()) -> None:
        """One launch reads our blocks and writes D's, in D's pool mapped here (``pool``:
        a :class:`~kvxfer.transport.cuda_peer.PeerPool`), queued on the device behind the
        producer's events (no host wait for them); DATA_DONE once the copy's event completed."""
        s = self._s
        done_frame = encode(Msg.DATA_DONE, req=op.wire_req, xid=op.post.xid, tag=0, pack=False,
                            blocks=[], layers=layers, heads=heads, offset=0, nbytes=nbytes)
        timeout = self._remaining(op)  # stop here if cancelled; once launched, the copy is waited for
        t0 = time.perf_counter()
        copied = s.device.copy_blocks(s.layout, op.ids, pool.layout, op.post.blocks, list(layers), heads, after)
        s.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="cuda_peer")
        s.device.wait(copied, timeout)
        s.metrics.observe("post_seconds", time.perf_counter() - t0)
        self._written(op, layers, done_frame)
        s.metrics.inc("bytes_sent", nbytes, path="cuda_peer")

    def _written(self, op: SendOp, layers: tuple, done_frame: bytes) -> None:
        """A direct piece (zero-copy, cuda_peer) is in D's blocks: tell D and count it visible,
        in one hold of the lock, so the lease timer either ends the op before (D is told
        that, never DATA_DONE) or finds it done: both sides agree on how it ended."""
        with self._s.lock:
            if op.ended is not None:
                raise TransferCancelled(f"{op.key[1]!r} ended ({op.ended}) while its bytes were landing")
            op.peer.send(done_frame)
            pending = op.pending
            for layer in layers:
                pending[layer] = pending.get(layer, 0) + 1
            self._sender.visible(op, layers)

    def _ship_pack(self, op: SendOp, layers: tuple, heads: tuple, after: tuple = ()) -> None:
        """The pack path, pipelined: up to :data:`PACK_DEPTH` chunks in flight, so chunk
        i+1 packs (on the device, behind the producer) while chunk i is on the wire and D
        unpacks chunk i-1. Chunks start, are written and finish in order. A chunk is
        written once D granted its slice and its pack completed; it finishes (slice freed,
        DATA_DONE) once the write completed. Nothing blocks on a grant while a written
        chunk of ours is unfinished: D may need that DATA_DONE (an unpack that frees its
        ring) before it can grant."""
        tile = self._s.layout.block_nbytes(heads)
        smaller = min(self._s.staging_bytes, op.peer.staging_bytes)
        limit = smaller // PACK_DEPTH
        pieces = collections.deque(pack_chunks(len(op.ids), layers, tile, limit))
        with self._s.lock:
            for lay, _ in pieces:
                for layer in lay:
                    op.pending[layer] = op.pending.get(layer, 0) + 1
        started: collections.deque = collections.deque()  # packing or packed, not yet written
        posted: collections.deque = collections.deque()  # writes in flight
        try:
            while pieces or started or posted:
                if pieces and len(started) + len(posted) < PACK_DEPTH:
                    chunk = self._start_chunk(op, *pieces[0], tile, heads, after, block=not (started or posted))
                    if chunk is not None:
                        pieces.popleft()
                        started.append(chunk)
                        continue
                if started and (started[0].grant.event.is_set() or not posted):
                    self._post_chunk(op, started[0])
                    posted.append(started.popleft())
                    continue
                self._finish_chunk(op, posted[0], heads)
                posted.popleft()
        except BaseException:
            for chunk in posted:  # the network may still read these slices: let the writes end first
                try:
                    if chunk.req is not None:
                        self._s.backend.wait(chunk.req, min(5.0, self._s.leases.default_ttl_s))
                except KVXferError:
                    pass
            for chunk in (*posted, *started):
                self._abandon_chunk(op, chunk)
            raise

    def _start_chunk(self, op: SendOp, lay: tuple, sl: slice, tile: int, heads: tuple, after: tuple,
                     block: bool) -> "_Chunk | None":
        """Take a slice of the local staging buffer (waiting for one only if ``block``, else
        None when none is free now), ask D for a slice of its ring, queue the pack."""
        ids = op.ids[sl]
        nbytes = len(ids) * len(lay) * tile
        t0 = time.perf_counter()
        off = self._s.pool.stage_out.alloc(nbytes, self._remaining(op) if block else 0)
        if off is None:
            if block:
                raise TransferTimeout("no room in the local staging buffer")
            return None
        chunk = _Chunk(lay, sl, nbytes, next(self._tags), _GrantWait(op.peer), off)
        with self._s.lock:
            self._grant_waits[chunk.tag] = chunk.grant
        op.peer.send(encode(Msg.STAGE_REQ, tag=chunk.tag, nbytes=nbytes))
        # queued on the device behind the producer's events; a slice freed early on
        # failure is only reused by later packs of the same (in-order) device stream
        chunk.packed = self._s.device.pack(self._s.layout, ids, list(lay), heads,
                                           self._s.pool.stage_out_t[off:off + nbytes], after)
        self._s.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="pack")
        return chunk

    def _post_chunk(self, op: SendOp, chunk: "_Chunk") -> None:
        """Wait for D's grant and the pack, then post the write (not waited for here)."""
        wait = chunk.grant
        if not wait.event.wait(self._remaining(op)):
            raise TransferTimeout("the receiver granted no staging space in time")
        if wait.error is not None:
            raise wait.error
        self._s.device.wait(chunk.packed, self._remaining(op))  # the slice holds the packed bytes
        self._remaining(op)
        descs = np.array([[self._s.pool.stage_out_region, chunk.off, wait.region, wait.offset, chunk.nbytes]],
                         dtype=np.int64)
        if self._s.pool.parts or op.peer.parts:
            descs = split_descs(descs, self._s.pool.parts, op.peer.parts)
        chunk.posted_at = time.perf_counter()
        chunk.req = self._s.backend.post(op.peer.bconn, "write", descs)

    def _finish_chunk(self, op: SendOp, chunk: "_Chunk", heads: tuple) -> None:
        """Wait for the write, free the local slice, tell D to unpack it (DATA_DONE)."""
        self._wait(chunk.req, self._remaining(op), op.key[1], f"write to {op.peer.name!r}")
        self._s.metrics.observe("post_seconds", time.perf_counter() - chunk.posted_at)
        chunk.req = None
        self._s.pool.stage_out.free(chunk.off)
        chunk.off = -1
        with self._s.lock:
            self._grant_waits.pop(chunk.tag, None)
            self._acks[chunk.tag] = (op, chunk.layers)
        self._s.metrics.inc("bytes_sent", chunk.nbytes, path="pack")
        op.peer.send(encode(Msg.DATA_DONE, req=op.wire_req, xid=op.post.xid, tag=chunk.tag, pack=True,
                            blocks=list(op.post.blocks[chunk.sl]), layers=list(chunk.layers), heads=heads,
                            offset=chunk.grant.offset, nbytes=chunk.nbytes))

    def _abandon_chunk(self, op: SendOp, chunk: "_Chunk") -> None:
        """A chunk that will not finish: give its grant back to D, free its local slice."""
        with self._s.lock:
            self._grant_waits.pop(chunk.tag, None)
            if chunk.grant.offset >= 0:
                op.peer.send(encode(Msg.STAGE_RELEASE, tag=chunk.tag))
        if chunk.off >= 0:
            self._s.pool.stage_out.free(chunk.off)
            chunk.off = -1

    def read(self, peer, completer, ids, remote, layers) -> None:
        """A one-sided read, on the send worker (it waits for the backend)."""
        self.worker.submit(lambda: self._read(peer, completer, ids, remote, layers))

    def _read(self, peer, completer, ids, remote, layers) -> None:
        handle = completer.handle
        try:
            heads = overlap(self._s.geometry.head_range, peer.geometry.head_range)
            if heads is None:
                raise LayoutMismatch("no kv heads in common")
            pool = peer.link.pool(peer.geometry, self._s.layout) if self._s.config.path == "auto" else None
            if pool is not None:
                return self._read_peer(peer, completer, ids, remote, layers, heads, pool)
            t0 = time.perf_counter()
            descs = zero_copy_descs(peer.geometry, remote, self._s.geometry, ids, layers, heads,
                                    peer.region_ids, self._s.pool.region_ids)
            descs = descs[:, [2, 3, 0, 1, 4]]  # (local, remote) columns for a read
            if self._s.pool.parts or peer.parts:
                descs = split_descs(descs, self._s.pool.parts, peer.parts)
            self._s.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="zero_copy")
            req = self._s.backend.post(peer.bconn, "read", descs)
            self._wait(req, self._s.leases.default_ttl_s, handle.request_id, f"read from {peer.name!r}")
            completer.set_path("zero_copy")
            completer.add_bytes(int(descs[:, 4].sum()))
            self._s.metrics.inc("bytes_received", handle.nbytes, path="zero_copy")
            if not handle.done():
                self._s.metrics.inc("transfers", kind="read", path="zero_copy")
            completer.succeed()
        except KVXferError as exc:
            if not handle.done():
                self._s.metrics.inc("failures", kind="read", error=type(exc).__name__)
            completer.fail(exc)

    def _read_peer(self, peer, completer, ids, remote, layers, heads, pool) -> None:
        """A one-sided read from a peer whose pool is mapped here: one launch."""
        s, handle = self._s, completer.handle
        t0 = time.perf_counter()
        copied = s.device.copy_blocks(pool.layout, remote, s.layout, ids, list(layers), heads)
        s.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="cuda_peer")
        s.device.wait(copied, s.leases.default_ttl_s)
        nbytes = len(ids) * len(layers) * s.layout.block_nbytes(heads)
        completer.set_path("cuda_peer")
        completer.add_bytes(nbytes)
        s.metrics.inc("bytes_received", nbytes, path="cuda_peer")
        if not handle.done():
            s.metrics.inc("transfers", kind="read", path="cuda_peer")
        completer.succeed()

    def unmap(self, peer) -> None:
        """Close ``peer``'s mapping once every copy queued before this call has finished
        (the send worker runs jobs in order, and each waits for its copy)."""
        self.worker.submit(peer.link.close)

    # ---- messages from D (I/O thread) ---------------------------------------------------
    def on_stage_grant(self, peer, f) -> None:
        with self._s.lock:
            wait = self._grant_waits.get(f["tag"])
            if wait is None or wait.peer is not peer:
                peer.send(encode(Msg.STAGE_RELEASE, tag=f["tag"]))  # we gave up on it
                return
            wait.region, wait.offset = f["region"], f["offset"]
        wait.event.set()

    def on_ack(self, peer, f) -> None:
        with self._s.lock:
            entry = self._acks.pop(f["tag"], None)
        if entry is None or entry[0].peer is not peer:
            return
        self._sender.visible(*entry)

    def peer_lost(self, peer, err) -> None:
        """Wake the pieces waiting for ``peer``'s grants; forget its ACKs; unmap its pool
        after the copies queued for it (lock held)."""
        self.unmap(peer)
        for wait in self._grant_waits.values():
            if wait.peer is peer:
                wait.error = err
                wait.event.set()
        for tag in [t for t, (op, _) in self._acks.items() if op.peer is peer]:
            del self._acks[tag]

    def abort_waits(self, err) -> None:
        """Wake every piece waiting for a grant with ``err`` (lock held; closing)."""
        for wait in self._grant_waits.values():
            wait.error = err
            wait.event.set()


def unpack_chunk(state: AgentState, f: dict) -> None:
    """Scatter the staged chunk a pack DATA_DONE ``f`` names (``offset``, ``nbytes`` in
    the inbound staging ring; ``blocks``, ``layers``, ``heads``) into the pool and wait
    until the device finished it (receive worker; TransferTimeout after the lease
    timeout, the slice then still being written)."""
    t0 = time.perf_counter()
    off, nbytes = f["offset"], f["nbytes"]
    unpacked = state.device.unpack(state.layout, state.pool.stage_in_t[off:off + nbytes], list(f["blocks"]),
                                   list(f["layers"]), f["heads"])
    state.device.wait(unpacked, state.leases.default_ttl_s)
    state.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="unpack")
