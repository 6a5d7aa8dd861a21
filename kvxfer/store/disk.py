"""``DiskTier``: a store node's second tier, a directory on local disk that outlives the node.

``kvxfer store --disk PATH --disk-capacity SIZE``: the directory holds

- ``LOCK``: held (``flock``) by the node using the directory, which writes its pid and
  host there; a second node pointed at it is refused (:class:`DiskLocked`);
- ``objects.dat``: the data file, ``SIZE`` bytes (sparse), objects in chunks placed
  by a :class:`~kvxfer.store.alloc.ChunkAllocator` (size classes, as in DRAM);
- ``journal``: a commit record per object written, a drop record per object gone
  (:mod:`kvxfer.store.journal`).

Objects are read and written by the native threads of a
:class:`kvxfer._C.DiskFile` (csrc/disk_io.h): one ``pread``/``pwrite`` a chunk, with
``O_DIRECT`` where the file system takes it (4 KiB-aligned chunks: objects of 64 KiB
and more), buffered otherwise. A write completes, then its commit record is appended:
only then is the object on disk (:meth:`DiskTier.finish_write`). A read hashes what it
read (XXH3-64) and is good only if that matches the record's ``dcrc``. Disk capacity is
evicted LRU (recency: order of arrival, refreshed by :meth:`DiskTier.touch`), with the
same page policy as DRAM (:func:`~kvxfer.store.alloc.victims_for`).

An object read back into DRAM leaves the tier (the tiers are exclusive) but its bytes
stay as a **shadow** (:meth:`DiskTier.shadow`) for as long as the tier has room: shadows
are evicted before any object, and a DRAM eviction of that object takes its shadow back
(:meth:`DiskTier.relink`) instead of writing the bytes again. A shadow names the DRAM
object it backs (its *twin*: the very object read from these bytes, or taken back into
DRAM while they were written) and only that object relinks it; when the twin leaves DRAM
any other way (a reader found its checksum wrong, a clear) the shadow is dropped
(:meth:`DiskTier.drop_shadow`), as is a shadow whose key is written anew. A shadow keeps
its commit record (it holds the committed bytes of its key), so a node killed while its
twin is in DRAM recovers it as an object; a relinked object's recency after a restart is
that of its first write.

At start the journal is replayed (:meth:`DiskTier.recover`): every object committed and
not dropped, whose chunk is consistent, is back, in its old recency order; the journal
is rewritten with those records only. A node restarted on the same directory therefore
serves what its disk held, in the same key space (keys carry the model's salt and block
size; objects their layout's ``fmt``).

Faults (``state``): a write that meets a full file system drops that object, and the
tier stops using more than it holds now for a minute (``full_drops``); a read-only file
system or a journal that cannot be appended stops write-back (``read-only``); a
directory removed under the node (``vanished``) empties the tier (a write that ends
afterwards is not committed). Reads that fail or do
not check are misses and drop the object (``bad_objects``). Each is logged once per
state change or per 10 s. Not thread-safe: the node's I/O thread owns it.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass

from .alloc import ChunkAllocator, chunk_bytes, victims_for
from .journal import COMMIT, DROP, Journal, Record, encode, replay

log = logging.getLogger("kvxfer.store")

__all__ = ["DiskTier", "DiskObj", "DiskLocked", "DiskConfig", "NO_DISK"]

FULL_BACKOFF_S = 60.0  # after a full file system, the tier keeps to what it holds this long
_LOG_EVERY_S = 10.0


class DiskLocked(OSError):
    """Another store node holds the directory (its ``LOCK``)."""


@dataclass(frozen=True)
class DiskConfig:
    """A node's disk tier (``kvxfer store --disk PATH --disk-capacity SIZE ...``).

    ``path``: its directory (created if absent); ``capacity_bytes``: the data file's size;
    ``threads``: I/O threads (1..64); ``sync``: ``fdatasync`` data and journal before an
    object counts as written (a host's power loss keeps it; a killed process is safe
    without); ``direct``: ``O_DIRECT`` where the file system takes it; ``queue_bytes``:
    DRAM chunks write-back may hold at once (None: a sixteenth of DRAM, at most 512 MiB;
    the node keeps twice that free);
    ``flush_s``: at shutdown, how long to spend writing DRAM's objects to disk (0: none);
    ``promote_timeout_s``: how long a get waits for objects read back from disk.
    """
    path: str
    capacity_bytes: int
    threads: int = 8
    sync: bool = False
    direct: bool = True
    queue_bytes: int | None = None
    flush_s: float = 30.0
    promote_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("the disk tier needs a directory path")
        for name in ("capacity_bytes", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.threads > 64:
            raise ValueError(f"threads must be at most 64, got {self.threads}")
        if self.queue_bytes is not None and (isinstance(self.queue_bytes, bool) or not isinstance(self.queue_bytes, int)
                                             or self.queue_bytes < 0):
            raise ValueError(f"queue_bytes must be an int >= 0, got {self.queue_bytes!r}")
        if not self.flush_s >= 0 or not self.promote_timeout_s > 0:
            raise ValueError("flush_s must be >= 0 and promote_timeout_s > 0")


# stats() of a node without a disk tier
NO_DISK = {"disk_state": "none", "disk_objects": 0, "disk_bytes_used": 0, "disk_capacity_bytes": 0,
           "disk_evictions": 0, "disk_bad_objects": 0, "disk_full_drops": 0, "disk_errors": 0, "disk_recovered": 0,
           "disk_recovered_bytes": 0, "disk_recovery_s": 0.0, "disk_direct": False, "disk_rounding_bytes": 0,
           "disk_bytes_written": 0, "disk_bytes_read": 0, "disk_shadows": 0, "disk_shadow_bytes": 0,
           "disk_relinks": 0}


@dataclass(eq=False)
class DiskObj:
    key: bytes
    offset: int  # of its chunk in the data file
    nbytes: int
    fmt: str
    crc: object  # the object's checksum as committed (what a get replies)
    dcrc: int = 0  # XXH3-64 of its bytes (checked when read back)
    pins: int = 0  # reads in flight
    committed: bool = False  # written and recorded (False: its write is in flight)
    gone: bool = False  # removed while pinned: its chunk is freed at the last unpin
    shadow: bool = False  # its object is in DRAM now; these bytes wait to be taken back or evicted
    twin: object = None  # a shadow: the DRAM object it backs (the only one that may relink it)


class DiskTier:
    """``DiskTier(path, capacity_bytes, largest_bytes, *, threads=8, sync=False, direct=True)``.

    ``largest_bytes``: the node's largest object. ``sync``: ``fdatasync`` the data before
    each commit record and the journal after each batch of them (survives a host's power
    loss; a killed process is safe without). ``on_gone(key)``: told of every key that
    leaves the tier (the node's key table). Raises :class:`DiskLocked` or ``OSError``
    when the directory cannot be used.
    """

    def __init__(self, path: str, capacity_bytes: int, largest_bytes: int, *, threads: int = 8,
                 sync: bool = False, direct: bool = True, on_gone=None) -> None:
        from .._native import load

        self.path = os.path.abspath(path)
        self.sync = bool(sync)
        self.on_gone = on_gone
        os.makedirs(self.path, exist_ok=True)
        self._lock_fd = _lock(self.path)
        self.file = None
        self.journal = None
        try:
            self.alloc = ChunkAllocator(capacity_bytes, largest_bytes)
            self.objects: OrderedDict[bytes, DiskObj] = OrderedDict()  # committed, LRU first
            self.shadows: OrderedDict[bytes, DiskObj] = OrderedDict()  # read back into DRAM, oldest first
            self.num_recovered = self.recovered_bytes = 0
            self.recovery_s = 0.0
            self._journal_path = os.path.join(self.path, "journal")
            self.recover()
            self._c = load()
            self.file = self._c.DiskFile(os.path.join(self.path, "objects.dat"), self.alloc.region_bytes,
                                         threads, direct)
            self.journal = Journal(self._journal_path)
        except BaseException:
            self.close(finish=False)
            raise
        self._jobs: dict[int, tuple] = {}  # job id -> (kind, DiskObj, context)
        self._ids = itertools.count(1)
        self.state = "ok"
        self.limit = self.alloc.region_bytes  # bytes it may hold (less after a full file system)
        self._limit_until = 0.0
        self.evictions = self.bad_objects = self.full_drops = self.errors = self.relinks = 0
        self.bytes_used = sum(o.nbytes for o in self.objects.values())
        self.shadow_bytes = 0
        self._logged: dict[str, float] = {}

    # ---- recovery ----------------------------------------------------------------------
    def recover(self) -> None:
        """Replay the journal into :attr:`objects` and rewrite it with the live records."""
        start = time.perf_counter()
        records, good, torn = replay(self._journal_path)
        live: OrderedDict[bytes, Record] = OrderedDict()
        for rec in records:
            if rec.kind == COMMIT:
                live.pop(rec.key, None)
                live[rec.key] = rec
            elif (old := live.get(rec.key)) is not None and old.offset == rec.offset:
                del live[rec.key]
        skipped = 0
        for rec in live.values():
            obj = DiskObj(rec.key, rec.offset, rec.nbytes, rec.fmt, rec.crc, rec.dcrc, committed=True)
            if self.alloc.claim(rec.offset, rec.nbytes, obj):
                self.objects[rec.key] = obj
            else:  # outside a smaller capacity, or at odds with a later record: not kept
                skipped += 1
        blobs = [encode(Record(COMMIT, o.key, o.offset, o.nbytes, o.dcrc, o.fmt, o.crc))
                 for o in self.objects.values()]
        try:
            journal = Journal(self._journal_path)
            try:
                journal.rewrite(blobs)
            finally:
                journal.close()
        except OSError as exc:  # read-only, full: keep the journal as it is, less a torn tail
            log.warning("disk tier %s: cannot rewrite the journal (%s); keeping it", self.path, exc)
            if torn:
                os.truncate(self._journal_path, good)
        self.num_recovered = len(self.objects)
        self.recovered_bytes = sum(o.nbytes for o in self.objects.values())
        self.recovery_s = time.perf_counter() - start
        if records or torn:
            log.info("disk tier %s: recovered %d objects (%.1f MB) in %.3f s from %d records%s%s", self.path,
                     self.num_recovered, self.recovered_bytes / 1e6, self.recovery_s, len(records),
                     f", {skipped} not kept" if skipped else "", ", a torn last record cut off" if torn else "")

    # ---- queries -----------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self.objects

    def peek(self, key: bytes) -> DiskObj | None:
        return self.objects.get(key)

    def touch(self, key: bytes) -> bool:
        """Refresh ``key``'s recency; False if it is not here."""
        if key not in self.objects:
            return False
        self.objects.move_to_end(key)
        return True

    @property
    def writable(self) -> bool:
        return self.state == "ok"

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    def stats(self) -> dict:
        f = self.file
        return {"disk_state": self.state, "disk_objects": len(self.objects), "disk_bytes_used": self.bytes_used,
                "disk_shadows": len(self.shadows), "disk_shadow_bytes": self.shadow_bytes, "disk_relinks": self.relinks,
                "disk_capacity_bytes": self.alloc.region_bytes, "disk_evictions": self.evictions,
                "disk_bad_objects": self.bad_objects, "disk_full_drops": self.full_drops,
                "disk_errors": self.errors, "disk_recovered": self.num_recovered,
                "disk_recovered_bytes": self.recovered_bytes, "disk_recovery_s": round(self.recovery_s, 6),
                "disk_direct": bool(f is not None and f.direct), "disk_rounding_bytes": self.alloc.rounding_bytes,
                "disk_bytes_written": f.bytes_written if f is not None else 0,
                "disk_bytes_read": f.bytes_read if f is not None else 0}

    # ---- writes --------------------------------------------------------------------------
    def write(self, key: bytes, nbytes: int, fmt: str, crc, addr: int, *, hash_bytes: bool, context=None):
        """Start writing the object ``key`` from host memory at ``addr`` (its chunk there:
        :func:`~kvxfer.store.alloc.chunk_bytes` ``(nbytes)`` bytes that stay valid until the
        write's completion is polled); ``hash_bytes``: compute its ``dcrc`` while writing
        (else ``crc``, a whole-object XXH3-64, is it). Returns the pending
        :class:`DiskObj`, or None when the tier takes no write now (not writable, or no
        chunk: everything pinned)."""
        if not self.writable or not self.alloc.fits(nbytes):
            return None
        self.drop_shadow(key)  # one not relinked is stale: the key is written anew
        obj = DiskObj(key, -1, nbytes, fmt, crc, 0 if hash_bytes else crc)
        off = self._reserve(obj)
        if off is None:
            return None
        obj.offset = off
        job = next(self._ids)
        self._jobs[job] = ("write", obj, context)
        self.file.submit(job, self._c.DISK_WRITE, off, addr, chunk_bytes(nbytes), nbytes if hash_bytes else 0,
                         self.sync)
        return obj

    def read(self, obj: DiskObj, addr: int, context=None) -> None:
        """Start reading committed ``obj`` into host memory at ``addr`` (its chunk's bytes;
        valid until the completion is polled). It is pinned (not evicted) meanwhile."""
        obj.pins += 1
        job = next(self._ids)
        self._jobs[job] = ("read", obj, context)
        self.file.submit(job, self._c.DISK_READ, obj.offset, addr, chunk_bytes(obj.nbytes), obj.nbytes)

    def poll(self) -> list:
        """The writes and reads that ended: ``[(kind, obj, context, ok)]``. A write that
        is ``ok`` is committed (recorded; readable from the tier now): the caller may
        still :meth:`remove` it. A read is ``ok`` when its bytes check against ``dcrc``;
        one that is not was counted and its object dropped."""
        out = []
        commits = []
        for job, err, crc, _ in self.file.drain():
            kind, obj, context = self._jobs.pop(job)
            if kind == "read":
                obj.pins -= 1
                if obj.gone and not obj.pins:
                    self.alloc.free(obj.offset)
                ok = err == 0 and crc == obj.dcrc
                if not ok and obj.committed and self.objects.get(obj.key) is obj:
                    self.bad_objects += 1
                    self._note("bad", f"object failed its read-back check ({os.strerror(err) if err else 'checksum'}); "
                                      "dropped")
                    self.remove(obj)
                out.append((kind, obj, context, ok))
                continue
            if err:
                self._write_failed(obj, err)
                out.append((kind, obj, context, False))
                continue
            if obj.dcrc == 0:
                obj.dcrc = crc
            commits.append((obj, context))
        if commits:
            ok = self._commit([o for o, _ in commits])
            out += [("write", o, ctx, ok) for o, ctx in commits]
        return out

    def remove(self, obj: DiskObj) -> None:
        """Drop committed ``obj``, or a shadow (its drop record, then its chunk is free)."""
        if obj.shadow:
            if self.shadows.get(obj.key) is not obj:
                return
            del self.shadows[obj.key]
            self.shadow_bytes -= obj.nbytes
            obj.twin = None
        elif self.objects.get(obj.key) is not obj:
            return
        else:
            del self.objects[obj.key]
            self.bytes_used -= obj.nbytes
        try:
            self.journal.append(encode(Record(DROP, obj.key, obj.offset)))
        except OSError as exc:  # the chunk cannot be reused safely: keep it, write nothing more
            self._stop_writes("read-only", exc)
        else:
            obj.gone = True
            if not obj.pins:
                self.alloc.free(obj.offset)
        if self.on_gone is not None and not obj.shadow:
            self.on_gone(obj.key)

    def shadow(self, obj: DiskObj, twin) -> None:
        """Committed ``obj``'s bytes are in DRAM now, as the object ``twin``: it leaves the
        tier (``on_gone``), its bytes stay as ``twin``'s shadow."""
        if self.objects.get(obj.key) is not obj:
            return
        del self.objects[obj.key]
        self.bytes_used -= obj.nbytes
        obj.shadow, obj.twin = True, twin
        self.shadows[obj.key] = obj
        self.shadow_bytes += obj.nbytes
        if self.on_gone is not None:
            self.on_gone(obj.key)

    def has_shadow(self, twin) -> bool:
        """DRAM object ``twin`` has a shadow here (:meth:`relink` would take it)."""
        obj = self.shadows.get(twin.key)
        return obj is not None and obj.twin is twin and self.state != "vanished"

    def relink(self, twin) -> bool:
        """DRAM evicts ``twin``: if its own shadow is here, that is the tier's object again
        (most recent), with nothing written (its commit record still stands); else False.
        A shadow of another object of the same key (a stale one) is never taken."""
        if not self.has_shadow(twin):
            return False
        obj = self.shadows[twin.key]
        if obj.nbytes != twin.nbytes or obj.fmt != twin.fmt or obj.crc != twin.crc:
            self.remove(obj)  # cannot happen (the twin was published with this record's size,
            return False  # format and checksum); were it to, the shadow is not that object
        del self.shadows[twin.key]
        self.shadow_bytes -= obj.nbytes
        obj.shadow, obj.twin = False, None
        self.objects[obj.key] = obj
        self.bytes_used += obj.nbytes
        self.relinks += 1
        return True

    def drop_shadow(self, key: bytes) -> None:
        """The DRAM object of ``key`` left DRAM other than by an eviction (or ``key`` is
        written anew): its shadow, if any, goes (its drop record, then its chunk is free)."""
        obj = self.shadows.get(key)
        if obj is not None:
            self.remove(obj)

    # ---- housekeeping ----------------------------------------------------------------------
    def check(self, now: float) -> None:
        """Periodic: notice a directory removed under the node; lift a full-disk limit."""
        if self.state != "vanished" and self.journal is not None and self.journal.vanished():
            # emptied first, the state last: whoever reads "vanished" (stats() from another
            # thread too) finds the tier empty and its keys gone
            for obj in list(self.objects.values()):
                del self.objects[obj.key]
                if self.on_gone is not None:
                    self.on_gone(obj.key)
            for obj in self.shadows.values():
                obj.twin = None
            self.shadows.clear()
            self.bytes_used = self.shadow_bytes = 0
            self.state = "vanished"
            log.error("disk tier %s: the directory was removed; the tier is dropped (the node serves DRAM only)",
                      self.path)
        if self.limit < self.alloc.region_bytes and now >= self._limit_until:
            self.limit = self.alloc.region_bytes

    def close(self, *, finish: bool = True) -> None:
        """Stop the I/O threads (``finish``: after the jobs queued), close the files, unlock."""
        if self.file is not None:
            self.file.close(finish)
        if self.journal is not None:
            self.journal.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # ---- internals -----------------------------------------------------------------------
    def _reserve(self, obj: DiskObj) -> int | None:
        """A chunk for ``obj``, evicting LRU objects (their drop records first) as needed."""
        chunk = chunk_bytes(obj.nbytes)
        while True:
            if self.alloc.bytes_allocated + chunk <= self.limit:
                off = self.alloc.alloc(obj.nbytes, obj)
                if off is not None:
                    return off
                # shadows go first (their objects are in DRAM), then LRU objects
                victims = (victims_for(self.alloc, self.shadows.values(), obj.nbytes, _evictable)
                           or victims_for(self.alloc, self.objects.values(), obj.nbytes, _evictable))
            else:  # over the limit a full file system set: make room, any class
                victims = next(([o] for o in itertools.chain(self.shadows.values(), self.objects.values())
                                if _evictable(o)), [])
            if not victims or not self.writable:
                return None
            for v in victims:
                self.evictions += not v.shadow
                self.remove(v)
            if not self.writable:  # a drop record failed
                return None

    def _commit(self, objs: list) -> bool:
        """Append the commit records of written ``objs`` and make them readable (not in a
        tier whose directory vanished: that would bring objects back into an emptied tier)."""
        if self.state == "vanished":
            for o in objs:
                self.alloc.free(o.offset)
            return False
        try:  # (with sync, each write synced its data before it completed)
            self.journal.append(b"".join(encode(Record(COMMIT, o.key, o.offset, o.nbytes, o.dcrc, o.fmt, o.crc))
                                         for o in objs))
            if self.sync:
                self.journal.sync()
        except OSError as exc:
            for o in objs:
                self.alloc.free(o.offset)
            if exc.errno == errno.ENOSPC:
                self.full_drops += len(objs)
                self._full(exc)
            else:
                self._stop_writes("read-only", exc)
            return False
        for o in objs:
            o.committed = True
            self.objects[o.key] = o
            self.bytes_used += o.nbytes
        return True

    def _write_failed(self, obj: DiskObj, err: int) -> None:
        self.alloc.free(obj.offset)
        if err == errno.ENOSPC:
            self.full_drops += 1
            self._full(OSError(err, os.strerror(err)))
        elif err in (errno.EROFS, errno.EACCES, errno.EPERM):
            self._stop_writes("read-only", OSError(err, os.strerror(err)))
        elif err != errno.ECANCELED:
            self.errors += 1
            self._note("error", f"a write failed: {os.strerror(err)}")

    def _full(self, exc: OSError) -> None:
        self.limit = self.alloc.bytes_allocated  # what it holds now fits; keep to it a while
        self._limit_until = time.monotonic() + FULL_BACKOFF_S
        self._note("full", f"the file system is full ({exc.strerror}): objects are dropped, the tier keeps "
                           f"to {self.limit / 1e6:.1f} MB for {FULL_BACKOFF_S:.0f} s")

    def _stop_writes(self, state: str, exc: OSError) -> None:
        if self.state == "ok":
            self.state = state
            log.error("disk tier %s: %s (%s): write-back stops; the tier still serves what it holds",
                      self.path, state, exc)

    def _note(self, what: str, message: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(what, -1e9) >= _LOG_EVERY_S:
            self._logged[what] = now
            log.warning("disk tier %s: %s", self.path, message)


def _evictable(obj: DiskObj) -> bool:
    return obj.committed and not obj.pins


def _lock(path: str) -> int:
    """Hold ``path/LOCK`` (flock, released when the process ends); :class:`DiskLocked` if
    another node holds it."""
    fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise DiskLocked(errno.EBUSY, f"{path} is in use by another store node ({holder})") from None
    except OSError:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # the lock holds; the note is for people
    return fd
