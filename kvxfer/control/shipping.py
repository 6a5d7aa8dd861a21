"""The send worker's half of the P side: plan a piece, move it, report it.

A piece is a set of layers of one send (all of them, or one per ``send_layer``).
:meth:`Shipper._choose` asks the cost model for the path; zero-copy posts the
coalesced descriptors straight into D's pool, pack gathers into P's staging
buffer in chunks, writes each into a slice of D's staging ring that D granted,
and D scatters it. DATA_DONE goes out only after the backend completed, so D
never sees a completion before the bytes.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .. import plan
from ..errors import (InvalidDescriptor, KVXferError, LayoutMismatch, ProtocolError, TransferCancelled,
                      TransferTimeout)
from .messages import Msg, encode
from .ops import SendOp
from .parts import split_descs

log = logging.getLogger("kvxfer")

INLINE_BYTES = 4 << 20  # zero-copy pieces up to this size are posted by the matching thread


class _GrantWait:
    def __init__(self, peer) -> None:
        self.peer = peer
        self.event = threading.Event()
        self.region = self.offset = -1
        self.error: KVXferError | None = None


class Shipper:
    """Mixin of :class:`~kvxfer.Agent`; uses its lock, layout, backend, staging and metrics."""

    def _remaining(self, op: SendOp) -> float:
        lease = self.leases.get(("send",) + op.key)
        if lease is None or op.ended is not None:
            raise TransferCancelled(f"{op.key[1]!r} stopped")
        return max(0.0, lease.deadline - time.monotonic())

    def _choose(self, op: SendOp, layers: tuple) -> tuple:
        """``(heads, path, nbytes)`` of one piece: the head overlap and the cost model's pick
        (a pure function of the peer's geometry and the piece's shape: cached)."""
        key = (op.peer.geometry, len(op.ids), layers, op.post.heads)
        cache = self.__dict__.setdefault("_choice_cache", {})
        choice = cache.get(key)
        if choice is None:
            choice = self._choose_uncached(op, layers)
            if len(cache) >= 256:
                cache.clear()
            cache[key] = choice
        return choice

    def _choose_uncached(self, op: SendOp, layers: tuple) -> tuple:
        heads = plan.overlap(self._geometry.head_range, op.post.heads)
        if heads is None:
            raise LayoutMismatch(f"no kv heads in common: sender {self._geometry.head_range}, "
                                 f"receiver {op.post.heads}")
        nbytes = len(op.ids) * len(layers) * self._layout.block_nbytes(heads)
        if self._path != "auto":
            return heads, self._path, nbytes
        num_descs = plan.count_runs(self._geometry, op.peer.geometry, len(op.ids), layers, heads)
        return heads, self._cost.choose(num_descs, nbytes), nbytes

    def _ship(self, op: SendOp, layers: tuple, choice, after: tuple = ()) -> None:
        try:
            if isinstance(choice, Exception):
                raise choice
            heads, path, nbytes = choice
            op.handle.path = path
            op.handle.nbytes += nbytes
            if path == "zero_copy":
                self._ship_zero_copy(op, layers, heads, nbytes, after)
            else:
                self._ship_pack(op, layers, heads, after)
        except KVXferError as exc:
            self._fail_send(op, exc, "expired" if isinstance(exc, TransferTimeout) else "failed")
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            self._fail_send(op, InvalidDescriptor(f"{op.key[1]!r}: {exc!r}"), "failed")
        except Exception as exc:  # noqa: BLE001 - a bug fails this request, never the worker
            log.exception("send worker: %r failed", op.handle)
            self._fail_send(op, ProtocolError(f"{op.key[1]!r}: internal error {exc!r}"), "failed")
        finally:
            with self._lock:
                op.inflight -= 1
                self._quiesce(op)

    def _post_and_wait(self, op: SendOp, kind: str, descs) -> None:
        t0 = time.perf_counter()
        if self._parts or op.peer.parts:
            descs = split_descs(descs, self._parts, op.peer.parts)
        req = self._backend.post(op.peer.bconn, kind, descs)
        self._backend.wait(req, self._remaining(op))
        self.metrics.observe("post_seconds", time.perf_counter() - t0)

    def _ship_zero_copy(self, op: SendOp, layers: tuple, heads: tuple, nbytes: int, after: tuple = ()) -> None:
        t0 = time.perf_counter()
        descs = plan.zero_copy_descs(self._geometry, op.ids, op.peer.geometry, op.post.blocks, layers,
                                     heads, self._region_ids, op.peer.region_ids)
        self.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="zero_copy")
        # ready before the write, so only the send is left between completion and D
        done_frame = encode(Msg.DATA_DONE, req=op.wire_req, xid=op.post.xid, tag=0, pack=False,
                            blocks=[], layers=layers, heads=heads, offset=0, nbytes=nbytes)
        # the network reads the pool directly: the producer must have finished writing it
        self._device.wait(after, self._remaining(op))
        self._remaining(op)  # stop here if cancelled meanwhile
        self._post_and_wait(op, "write", descs)
        op.peer.send(done_frame)
        with self._lock:
            pending = op.pending
            for layer in layers:
                pending[layer] = pending.get(layer, 0) + 1
        self.metrics.inc("bytes_sent", nbytes, path="zero_copy")
        self._pieces_visible(op, layers)

    def _ship_pack(self, op: SendOp, layers: tuple, heads: tuple, after: tuple = ()) -> None:
        tile = self._layout.block_nbytes(heads)
        limit = min(self._staging_bytes, op.peer.staging_bytes) // 2
        pieces = plan.chunks(len(op.ids), layers, tile, limit)
        with self._lock:
            for lay, _ in pieces:
                for layer in lay:
                    op.pending[layer] = op.pending.get(layer, 0) + 1
        for lay, sl in pieces:
            ids = op.ids[sl]
            nbytes = len(ids) * len(lay) * tile
            tag, wait = next(self._tags), _GrantWait(op.peer)
            with self._lock:
                self._grant_waits[tag] = wait
            op.peer.send(encode(Msg.STAGE_REQ, tag=tag, nbytes=nbytes))
            t0 = time.perf_counter()
            off = self._stage_out.alloc(nbytes, self._remaining(op))
            if off is None:
                raise TransferTimeout("no room in the local staging buffer")
            try:
                # queued on the device behind the producer's events; a slice freed early on
                # failure is only reused by later packs of the same (in-order) device stream
                packed = self._device.pack(self._layout, list(ids), list(lay), heads,
                                           self._stage_out_t[off:off + nbytes], after)
                self.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="pack")
                if not wait.event.wait(self._remaining(op)):
                    raise TransferTimeout("the receiver granted no staging space in time")
                if wait.error is not None:
                    raise wait.error
                self._device.wait(packed, self._remaining(op))  # the slice holds the packed bytes
                self._remaining(op)
                self._post_and_wait(op, "write", np.array(
                    [[self._stage_out_region, off, wait.region, wait.offset, nbytes]], dtype=np.int64))
            except BaseException:
                with self._lock:
                    self._grant_waits.pop(tag, None)
                    if wait.offset >= 0:
                        op.peer.send(encode(Msg.STAGE_RELEASE, tag=tag))
                raise
            finally:
                self._stage_out.free(off)
            with self._lock:
                self._grant_waits.pop(tag, None)
                self._acks[tag] = (op, lay)
            self.metrics.inc("bytes_sent", nbytes, path="pack")
            op.peer.send(encode(Msg.DATA_DONE, req=op.wire_req, xid=op.post.xid, tag=tag, pack=True,
                                blocks=list(op.post.blocks[sl]), layers=list(lay), heads=heads,
                                offset=wait.offset, nbytes=nbytes))

    def _pieces_visible(self, op: SendOp, layers) -> None:
        with self._lock:
            done = []
            pending = op.pending
            for layer in layers:
                n = pending[layer] - 1
                pending[layer] = n
                if n == 0:
                    done.append(layer)
            op.visible.update(done)
            op.handle._mark_layers(done)
            if op.ended is None and op.target <= op.visible:
                self._finish_send(op)

    def _do_read(self, peer, handle, ids, remote, layers) -> None:
        try:
            heads = plan.overlap(self._geometry.head_range, peer.geometry.head_range)
            if heads is None:
                raise LayoutMismatch("no kv heads in common")
            t0 = time.perf_counter()
            descs = plan.zero_copy_descs(peer.geometry, remote, self._geometry, ids, layers, heads,
                                         peer.region_ids, self._region_ids)
            descs = descs[:, [2, 3, 0, 1, 4]]  # (local, remote) columns for a read
            if self._parts or peer.parts:
                descs = split_descs(descs, self._parts, peer.parts)
            self.metrics.observe("prepare_seconds", time.perf_counter() - t0, path="zero_copy")
            req = self._backend.post(peer.bconn, "read", descs)
            self._backend.wait(req, self.leases.default_ttl_s)
            handle.path, handle.nbytes = "zero_copy", int(descs[:, 4].sum())
            self.metrics.inc("bytes_received", handle.nbytes, path="zero_copy")
            if not handle.done():
                self.metrics.inc("transfers", kind="read", path="zero_copy")
            handle._succeed()
        except KVXferError as exc:
            if not handle.done():
                self.metrics.inc("failures", kind="read", error=type(exc).__name__)
            handle._fail(exc)
