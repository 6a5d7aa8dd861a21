"""``Tiers``: a store node's DRAM and its disk tier, kept as one pool.

Clients write and read DRAM (the :class:`~kvxfer.store.index.SlotIndex` over the
registered buffer); the :class:`~kvxfer.store.disk.DiskTier` holds what DRAM let go.
The tiers are exclusive: an object is in one of them (briefly in both while it moves).

- **Write-back.** An object evicted from DRAM ahead of need (the bytes in use above the
  high watermark) is written to disk instead of dropped: its chunk stays held until the
  write ended, then is freed. At most ``queue_bytes`` of chunks are held at once; past
  that, or when a chunk is needed at once (a reserve that found none free), the object
  is dropped and counted (``writeback_drops``): write-back never holds up a put.
- **Presence.** A key on either tier, or being written back, is present: lookups (the
  key table too) show it, a put of it is a no-op that refreshes it (on disk: its recency).
- **Gets.** A key in DRAM is served at once. One being written back is taken back into
  DRAM (its chunk still holds it). One only on disk is read back into a DRAM chunk (a
  *promotion*: it then leaves the disk, its bytes staying there as a shadow that a later
  DRAM eviction of that object takes back without a write; any other removal from DRAM
  drops the shadow), its bytes checked against the disk record's
  checksum (a bad one is a miss, and the object is dropped), and served from DRAM. A
  get's reply waits for its promotions, at most ``promote_timeout_s``; one not done by
  then misses (it still lands in DRAM for the next get). Gets of one key share its read.

All of it runs on the node's I/O thread: :meth:`Tiers.poll` when the disk's event fd is
readable, :meth:`Tiers.tick` every tick.
"""
from __future__ import annotations

import logging
import select
import time
from dataclasses import dataclass, field

from .alloc import chunk_bytes
from .disk import NO_DISK
from .protocol import NO_CRC

log = logging.getLogger("kvxfer.store")

__all__ = ["Tiers", "PendingGet", "TIER_COUNTS"]

# the per-tier figures of a node's stats() that add up over nodes (KVStore.stats() sums them)
TIER_COUNTS = ("dram_hits", "disk_hits", "dram_evictions", "disk_evictions", "dram_objects", "disk_objects",
               "dram_bytes_used", "disk_bytes_used", "dram_capacity_bytes", "disk_capacity_bytes",
               "writeback_queue", "writeback_queue_bytes", "writeback_objects", "writeback_bytes", "writeback_drops",
               "writeback_rescues", "disk_promotions", "disk_promote_failures", "disk_bad_objects",
               "disk_full_drops", "disk_errors", "disk_recovered", "disk_recovered_bytes", "disk_bytes_written",
               "disk_bytes_read", "disk_shadows", "disk_shadow_bytes", "disk_relinks")


@dataclass(eq=False)
class _Promotion:
    key: bytes
    dobj: object  # the DiskObj read back (pinned meanwhile)
    obj: object = None  # its DRAM chunk (a staged Obj) once one was had
    done: bool = False
    ok: bool = False
    waiters: list = field(default_factory=list)  # PendingGets waiting for it to end
    holds: int = 0  # PendingGets not answered yet: the object stays pinned in DRAM for them


@dataclass(eq=False)
class PendingGet:
    """A GET whose reply waits for promotions (the node's; see :meth:`Tiers.start_get`)."""
    client: object
    rid: int
    fields: dict
    deadline: float
    remaining: int = 0
    promoted: set = field(default_factory=set)  # keys read back from disk for it
    promos: list = field(default_factory=list)  # their _Promotions


class Tiers:
    """``Tiers(index, buffer_addr, keys, disk=None, *, queue_bytes, promote_timeout_s=1.0)``.

    ``index``: the node's DRAM index over the buffer at ``buffer_addr``; ``keys``: its
    :class:`~kvxfer.store.key_table.KeyTable`; ``disk``: a
    :class:`~kvxfer.store.disk.DiskTier` or None (DRAM only). Installs itself as the
    index's mirror and second-tier hooks.
    """

    def __init__(self, index, buffer_addr: int, keys, disk=None, *, queue_bytes: int = 256 << 20,
                 promote_timeout_s: float = 1.0) -> None:
        self.index, self.base, self.keys, self.disk = index, buffer_addr, keys, disk
        self.queue_bytes = int(queue_bytes)
        self.promote_timeout_s = float(promote_timeout_s)
        self._writeback: dict = {}  # key -> DRAM Obj being written to disk (its chunk held)
        self._queued = 0  # chunk bytes held by writes in flight
        self._promos: dict = {}  # key -> _Promotion in flight
        self._want_chunk: list = []  # promotions waiting for a DRAM chunk
        self._ready: list = []  # PendingGets whose promotions all ended
        self.writeback_objects = self.writeback_bytes = self.writeback_drops = self.rescues = 0
        self._busy_s, self._busy_since = 0.0, 0.0  # wall time with writes in flight
        self.promotions = self.promote_failures = self.disk_hits = 0
        index.mirror = self
        if disk is not None:
            index.on_evict, index.elsewhere, disk.on_gone = self._on_evict, self._elsewhere, self._disk_gone
            index.can_hold = self._can_hold
            for key in disk.objects:  # recovered: published like any other key
                keys.add(key)

    # ---- presence ------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """``key`` is readable from some tier (a lookup's answer; recency untouched)."""
        return self.index.contains(key) or key in self._writeback or (self.disk is not None and self.disk.contains(key))

    def _elsewhere(self, key: bytes) -> bool:
        return key in self._writeback or self.disk.touch(key)

    # the index's mirror: a key is published while some tier holds it
    def add(self, key: bytes) -> None:
        if key not in self._writeback and not (self.disk is not None and self.disk.contains(key)):
            self.keys.add(key)

    def remove(self, key: bytes) -> None:
        # the DRAM object left: an eviction relinked its shadow already (see _on_evict), any
        # other removal (a bad checksum, a clear) ends the shadow with the object it backed
        if self.disk is not None:
            self.disk.drop_shadow(key)
        if key not in self._writeback and not (self.disk is not None and self.disk.contains(key)):
            self.keys.remove(key)

    def _disk_gone(self, key: bytes) -> None:
        if not self.index.contains(key) and key not in self._writeback:
            self.keys.remove(key)

    # ---- write-back ------------------------------------------------------------------------
    def _can_hold(self, obj) -> bool:
        """An eviction ahead of need waits while the write-back queue has no room for ``obj``
        (it would be dropped); a tier that takes no writes does not hold it up."""
        return (not self.disk.writable or self.disk.has_shadow(obj)
                or self._queued + chunk_bytes(obj.nbytes) <= self.queue_bytes)

    def _on_evict(self, obj, hold: bool) -> bool:
        """The index evicts ``obj``: its shadow on disk takes it back (nothing written), or
        its write to disk starts (keeping its chunk) when it may."""
        if self.disk.relink(obj):
            return False
        chunk = chunk_bytes(obj.nbytes)
        if not hold or self._queued + chunk > self.queue_bytes:
            self.writeback_drops += 1
            return False
        whole = type(obj.crc) is int and obj.crc != NO_CRC  # else the disk write hashes the bytes
        if self.disk.write(obj.key, obj.nbytes, obj.fmt, obj.crc, self.base + obj.offset, hash_bytes=not whole,
                           context=obj) is None:
            self.writeback_drops += 1
            return False
        self._writeback[obj.key] = obj  # before the index removes it: the key stays published
        obj.pins += 1
        self._hold(chunk)
        return True

    def _hold(self, chunk: int) -> None:
        if not self._queued:
            self._busy_since = time.monotonic()
        self._queued += chunk

    @property
    def queued_objects(self) -> int:
        return len(self._writeback)

    # ---- gets --------------------------------------------------------------------------------
    def start_get(self, client, rid: int, fields: dict, now: float) -> PendingGet | None:
        """Before a GET is served: take back keys being written back, start (or join)
        the promotions of keys only on disk (of the asked ``fmt``). Returns a
        :class:`PendingGet` when the reply must wait for promotions, else None."""
        if self.disk is None:
            return None
        pending = None
        for key in fields["keys"]:
            if self.index.contains(key):
                continue
            if key in self._writeback:
                self.rescue(key)
                continue
            dobj = self.disk.peek(key)
            if dobj is None or dobj.fmt != fields["fmt"]:
                continue
            p = self._promos.get(key)
            if p is None:
                p = self._promos[key] = _Promotion(key, dobj)
                dobj.pins += 1
                self._start(p)
            if pending is None:
                pending = PendingGet(client, rid, fields, now + self.promote_timeout_s)
            if key not in pending.promoted:
                pending.promoted.add(key)
                if not p.done:
                    pending.remaining += 1
                    pending.promos.append(p)
                    p.waiters.append(pending)
                    p.holds += 1
        return pending if pending is not None and pending.remaining else None

    def rescue(self, key: bytes) -> bool:
        """A get wants ``key`` while it is being written back: it is DRAM's again (the write
        ends unrecorded). False if it is not being written back."""
        obj = self._writeback.get(key)
        if obj is None:
            return False
        self.index.readmit(obj)
        del self._writeback[key]
        self.rescues += 1
        return True

    def take_ready(self) -> list:
        out, self._ready = self._ready, []
        return out

    def answered(self, pending: PendingGet) -> None:
        """``pending`` was answered (or its client left): the objects read back for it
        are no longer kept in DRAM on its account."""
        for p in pending.promos:
            p.holds -= 1
            if p.holds == 0 and p.ok:
                self.index.unpin_node(p.obj)
        pending.promos = []

    def _start(self, p: _Promotion) -> None:
        """Give promotion ``p`` a DRAM chunk and start its read (or queue it for a chunk)."""
        n = p.dobj.nbytes
        obj = self.index.stage(p.key, n, p.dobj.fmt)
        if obj is None and self.index.make_room(n):
            obj = self.index.stage(p.key, n, p.dobj.fmt)
        if obj is None:
            if self._queued or self.disk.jobs:  # chunks come back as writes end
                self._want_chunk.append(p)
            else:
                self._end(p, False)
            return
        p.obj = obj
        self.disk.read(p.dobj, self.base + obj.offset, context=p)

    def _end(self, p: _Promotion, ok: bool) -> None:
        p.done, p.ok = True, ok
        self._promos.pop(p.key, None)
        self._unpin(p.dobj)
        if not ok:
            self.promote_failures += 1
        for w in p.waiters:
            w.remaining -= 1
            if w.remaining == 0:
                self._ready.append(w)
        p.waiters = []

    def _unpin(self, dobj) -> None:
        dobj.pins -= 1
        if dobj.gone and not dobj.pins:
            self.disk.alloc.free(dobj.offset)

    # ---- completions -------------------------------------------------------------------------
    def poll(self) -> None:
        """Handle the disk's completed writes and reads (its event fd was readable)."""
        if self.disk is None:
            return
        for kind, dobj, ctx, ok in self.disk.poll():
            if kind == "write":
                self._write_ended(ctx, dobj, ok)
            elif ok:  # a promotion's bytes check: DRAM's now (pinned until its gets were answered)
                self.index.publish_staged(ctx.obj, dobj.crc)
                if ctx.holds:
                    self.index.pin_node(ctx.obj)
                self.disk.shadow(dobj, ctx.obj)  # the disk's copy stays as its shadow while there is room
                self.promotions += 1
                self._end(ctx, True)
            else:
                self.index.unstage(ctx.obj)
                self._end(ctx, False)
        self.index.trim()  # the queue drained some: evictions ahead of need go on
        if self._want_chunk:
            waiting, self._want_chunk = self._want_chunk, []
            for p in waiting:
                self._start(p)

    def _write_ended(self, obj, dobj, ok: bool) -> None:
        key = obj.key
        ours = self._writeback.get(key) is obj
        if ours:
            del self._writeback[key]
        if ok and ours:
            self.writeback_objects += 1
            self.writeback_bytes += obj.nbytes
        elif ok and self.index.peek(key) is obj:  # taken back into DRAM meanwhile: the copy is its shadow
            self.disk.shadow(dobj, obj)
        elif ok:  # taken back, then gone from DRAM (not evicted: it was pinned by this write)
            self.disk.remove(dobj)
        elif ours and not self.index.contains(key) and not self.disk.contains(key):
            self.keys.remove(key)  # the write failed: the object is gone
        self._queued -= chunk_bytes(obj.nbytes)
        if not self._queued:
            self._busy_s += time.monotonic() - self._busy_since
        self.index.unhold(obj)

    def tick(self, now: float) -> None:
        """Periodic: the disk's checks; promotions waiting for a chunk that none will free fail."""
        if self.disk is None:
            return
        self.disk.check(now)
        self.index.trim()
        if self._want_chunk and not (self._queued or self.disk.jobs):
            waiting, self._want_chunk = self._want_chunk, []
            for p in waiting:
                self._start(p)

    # ---- stats and shutdown ------------------------------------------------------------------
    def stats(self) -> dict:
        hits = self.index.hits
        out = {"dram_hits": hits - self.disk_hits, "disk_hits": self.disk_hits, "dram_evictions": self.index.evictions,
               "dram_objects": len(self.index), "dram_bytes_used": self.index.bytes_used,
               "dram_capacity_bytes": self.index.region_bytes, "writeback_queue": len(self._writeback),
               "writeback_queue_bytes": self._queued, "writeback_objects": self.writeback_objects,
               "writeback_bytes": self.writeback_bytes, "writeback_drops": self.writeback_drops,
               "writeback_rescues": self.rescues, "disk_promotions": self.promotions,
               "writeback_busy_s": self._busy_s + (time.monotonic() - self._busy_since if self._queued else 0.0),
               "disk_promote_failures": self.promote_failures}
        out.update(self.disk.stats() if self.disk is not None else NO_DISK)
        return out

    def flush(self, timeout_s: float) -> None:
        """Shutdown (the I/O thread stopped): write DRAM's objects to disk, least recently
        used first (so recency carries over), within ``timeout_s``; log what was written."""
        d = self.disk
        if d is None or not d.writable or timeout_s <= 0 or not len(self.index):
            return
        start = time.monotonic()
        deadline = start + timeout_s
        written, nbytes = self.writeback_objects, self.writeback_bytes
        for obj in list(self.index._objects.values()):
            chunk = chunk_bytes(obj.nbytes)
            while self._queued + chunk > self.queue_bytes and time.monotonic() < deadline:
                self._wait(deadline)
            if time.monotonic() >= deadline or not d.writable:
                break
            if obj.key in self._writeback or d.contains(obj.key) or d.relink(obj):
                continue
            whole = type(obj.crc) is int and obj.crc != NO_CRC
            if d.write(obj.key, obj.nbytes, obj.fmt, obj.crc, self.base + obj.offset, hash_bytes=not whole,
                       context=obj) is not None:
                self._writeback[obj.key] = obj
                obj.pins += 1
                self._hold(chunk)
                self.index.held_bytes += chunk
        while self._queued and time.monotonic() < deadline:
            self._wait(deadline)
        log.info("disk tier %s: wrote %d objects (%.1f MB) of DRAM at shutdown in %.2f s%s", d.path,
                 self.writeback_objects - written, (self.writeback_bytes - nbytes) / 1e6, time.monotonic() - start,
                 "" if not self._queued else " (time ran out)")

    def _wait(self, deadline: float) -> None:
        select.select([self.disk.file.event_fd], [], [], max(0.0, min(0.1, deadline - time.monotonic())))
        self.poll()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close(finish=True)
