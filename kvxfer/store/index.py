"""A store node's index: objects in chunks of one buffer, key -> object, LRU, pins.

An object (:mod:`kvxfer.store.records`) lives in one chunk of the node's buffer, placed
by a :class:`~kvxfer.store.alloc.ChunkAllocator` (size classes share the capacity;
``largest_bytes`` is the largest it takes): *pending* (reserved, being written; invisible
to gets and lookups), then *committed* (readable, immutable). A commit names the
reservation's token, so a late commit of a reservation handed to someone else is refused.

An object is written whole (:meth:`SlotIndex.reserve`, one client) or in **parts**
(:meth:`SlotIndex.reserve_part`: the ranks of a TP group, each naming its head range
``[lo, hi)`` of ``num_heads``). The first part's reservation takes the slot, later
ones join it (same slot, a token each); a part whose range overlaps one already held
but differs from it is refused (:data:`CONFLICT`), an equal one is :data:`BUSY` (its
heads are being written). Each part commits alone, with its own checksum; the object
becomes readable when the committed parts cover every head exactly once, and its
checksum is then the list ``[[lo, hi, crc], ...]`` in head order. Until then it is
pending as a whole: its lease (renewed by each joining part) lapsing, any of its
uncommitted parts being aborted, or the client holding one leaving drops the whole
object and frees its slot. Each part counts against its client's ``max_pending``
until the object is committed or dropped (a committed part of an object that never
completes still holds a slot, so it still counts).

Eviction frees the least recently used committed object that no reader pins (pinned
objects leave the LRU list while pinned, so a victim is found in O(1) however many are),
whenever the chunk bytes in use (pending and committed, less those an eviction still
holds) exceed the high watermark ``high_watermark * capacity``; every such eviction is
counted. A chunk needed now when none of its class is free (nor a free page) evicts
the LRU object if it is of that class, else every object of the page holding the LRU
object (a page of another class, taken over once empty; pages with a pinned or pending
chunk are passed over). A pinned object is never evicted: a reader holds a pin from its
get until it released it (or its lease ran out). An object dropped while pinned (a bad
checksum) leaves the index at once and frees its slot when the last pin goes.

A client may also hold **spare** slots (:meth:`SlotIndex.reserve_spare`): reserved for it
under no key, lapsing like reservations; it commits an object written into one under its
key in one step (:meth:`SlotIndex.commit_spare`); a spare whose key turned out present or
busy stays the client's. With ``quotas`` (:class:`~kvxfer.store.quotas.Quotas`) the chunk
bytes of reservations and spares are bounded per client identity and in total: past a
bound they answer :data:`LIMIT` before anything is evicted for them.

``mirror``: an object with ``add(key)`` and ``remove(key)`` told of every key that
becomes readable and every one that stops being readable (a node's
:class:`~kvxfer.store.key_table.KeyTable`).

Hooks for a second tier (:mod:`kvxfer.store.tiers`): ``on_evict(obj, hold)`` is told of
each evicted object before it leaves the index; with ``hold`` (an eviction that makes
room ahead of need) it may keep the object's chunk for a while by taking a pin
(``obj.pins += 1``, counted in ``held_bytes``) and give it back with :meth:`SlotIndex.unhold`;
without ``hold`` (a chunk is needed now) the chunk is freed at once. ``can_hold(obj)``,
asked before each eviction ahead of need, may say wait (the second tier cannot take it
yet): the trim stops there and goes on at :meth:`SlotIndex.trim`. ``elsewhere(key)``
says whether another tier holds ``key`` (a reserve of it is then a no-op: PRESENT).

Not thread-safe: a node's one I/O thread owns it. Times are ``time.monotonic()``
seconds passed in by the caller.
"""
from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict

from .alloc import ChunkAllocator, chunk_bytes, victims_for
from .protocol import BUSY, COMMITTED, CONFLICT, FULL, LIMIT, NO_SPARE, PRESENT, REFUSED, RESERVED
from .quotas import Holdings
from .records import Obj, Part, Pin as _Pin, evictable as _evictable

__all__ = ["SlotIndex", "Obj", "Part", "PRESENT", "RESERVED", "BUSY", "FULL", "LIMIT", "CONFLICT", "COMMITTED",
           "NO_SPARE", "REFUSED"]  # (the codes: kvxfer.store.protocol's, re-exported)


class SlotIndex:
    """``SlotIndex(capacity_bytes, largest_bytes, high_watermark=0.98, max_pending=4096, max_pins=65536, mirror=None)``.

    ``capacity_bytes``: the buffer (rounded down to whole pages: ``region_bytes``);
    ``largest_bytes``: the largest object it takes (``slot_bytes``; ``num_slots`` is how
    many of those the region holds). ``max_pending`` / ``max_pins``: per client, the
    reservations and pins it may hold at once (more: that key's request answers
    :data:`LIMIT`). ``mirror``: see the module doc. ``quotas``: a
    :class:`~kvxfer.store.quotas.Quotas` bounding the bytes of reservations and spares per
    client identity (:meth:`identify`) and in total (past them: :data:`LIMIT`, nothing
    evicted); None: unbounded.
    """

    def __init__(self, capacity_bytes: int, largest_bytes: int, *, high_watermark: float = 0.98,
                 max_pending: int = 4096, max_pins: int = 65536, mirror=None, quotas=None) -> None:
        if not 0.0 < high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark}")
        self.alloc = ChunkAllocator(capacity_bytes, largest_bytes)
        self.slot_bytes = largest_bytes
        self.region_bytes = self.alloc.region_bytes
        self.num_slots = self.region_bytes // largest_bytes
        self.watermark = max(1, int(high_watermark * self.region_bytes))  # bytes
        self.max_pending, self.max_pins = max_pending, max_pins
        # byte bounds of what clients hold (kvxfer.store.quotas.Quotas; None: unbounded)
        self.quotas = quotas
        self.holdings = Holdings(quotas.caps(self.region_bytes, chunk_bytes(largest_bytes)) if quotas else None)
        self.mirror = mirror
        self.on_evict = self.elsewhere = self.can_hold = None  # a second tier's hooks (see the module doc)
        self.held_bytes = 0  # chunk bytes of evicted objects that on_evict holds
        self._objects: OrderedDict[bytes, Obj] = OrderedDict()  # committed, LRU first
        # the committed objects eviction may take (unpinned), LRU first: a pinned object
        # leaves it while pinned, so finding a victim never passes over pins
        self._lru: OrderedDict[bytes, Obj] = OrderedDict()
        self._pending: dict[bytes, Obj] = {}
        self._spares: dict[int, Obj] = {}  # token -> a slot reserved for a client under no key
        self._pins: dict[int, _Pin] = {}
        self._tokens = itertools.count(1)
        self._pending_by: dict[int, int] = {}
        self._pins_by: dict[int, int] = {}
        self.hits = self.misses = self.evictions = self.bad = 0
        self.bytes_used = 0  # bytes of committed objects

    # ---- queries ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._objects)

    @property
    def slots_used(self) -> int:
        """Chunks in use (committed, pending, spare, or held by an eviction)."""
        return self.alloc.chunks_used

    def contains(self, key: bytes) -> bool:
        """Committed (readable) now; does not touch recency."""
        return key in self._objects

    def peek(self, key: bytes) -> Obj | None:
        """The committed object of ``key`` (or None); does not touch recency or counters."""
        return self._objects.get(key)

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "bad_objects": self.bad, "objects": len(self._objects), "pending": len(self._pending),
                "spares": len(self._spares), "reserved_bytes": self.holdings.held_total,
                "spare_bytes": self.holdings.spared_total, "quota_refusals": self.holdings.num_limited,
                "pins": len(self._pins), "bytes_used": self.bytes_used,
                "slots_used": self.slots_used, "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes, "capacity_bytes": self.region_bytes,
                "bytes_allocated": self.alloc.bytes_allocated, "rounding_bytes": self.alloc.rounding_bytes,
                "size_classes": self.alloc.stats()["classes"]}

    def fits(self, nbytes: int) -> bool:
        """An object of ``nbytes`` can be held (at most ``slot_bytes``)."""
        return self.alloc.fits(nbytes)

    # ---- put -------------------------------------------------------------------------
    def reserve(self, key: bytes, nbytes: int, fmt: str, owner: int, now: float, lease_s: float):
        """``(PRESENT | BUSY | FULL | LIMIT, None)`` or ``(RESERVED, obj)``.

        PRESENT: committed already (its recency is refreshed: a put of a present key is
        a no-op); BUSY: another client is writing it; FULL: every slot is pending or pinned.
        """
        if not self.fits(nbytes):
            raise ValueError(f"object of {nbytes} bytes exceeds the largest this node holds ({self.slot_bytes} B)")
        obj = self._objects.get(key)
        if obj is not None:
            self._touch(obj)
            return PRESENT, None
        if self.elsewhere is not None and self.elsewhere(key):
            return PRESENT, None
        obj = self._pending.get(key)
        if obj is not None:
            if obj.deadline > now:
                return BUSY, None
            self._unreserve(obj)
        if self._pending_by.get(owner, 0) >= self.max_pending or not self._may_hold(owner, nbytes):
            return LIMIT, None
        obj = self._new_slot(Obj(key, -1, nbytes, fmt, owner, next(self._tokens), now + lease_s))
        return (RESERVED, obj) if obj is not None else (FULL, None)

    def reserve_part(self, key: bytes, nbytes: int, fmt: str, lo: int, hi: int, num_heads: int,
                     owner: int, now: float, lease_s: float):
        """Reserve heads ``[lo, hi)`` of ``num_heads`` of the object ``key`` (``nbytes``:
        the whole object's size). ``(RESERVED, obj, part)``: write the part into
        ``obj.offset`` and commit ``part.token``; else ``(code, None, None)``: PRESENT
        (committed already; recency refreshed), BUSY (a whole put of the key, or a part of
        exactly these heads, is being written), CONFLICT (the key is being assembled from
        parts that overlap ``[lo, hi)`` without being equal to it, or of another size,
        format or head count), FULL, LIMIT.
        """
        if not self.fits(nbytes):
            raise ValueError(f"object of {nbytes} B exceeds the largest this node holds ({self.slot_bytes} B)")
        if not 0 <= lo < hi <= num_heads:
            raise ValueError(f"heads [{lo}, {hi}) are not a range of {num_heads}")
        if key in self._objects:
            self._touch(self._objects[key])
            return PRESENT, None, None
        if self.elsewhere is not None and self.elsewhere(key):
            return PRESENT, None, None
        obj = self._pending.get(key)
        if obj is not None and obj.deadline <= now:
            self._unreserve(obj)
            obj = None
        if obj is not None:
            if obj.parts is None:
                return BUSY, None, None
            if (obj.nbytes, obj.fmt, obj.num_heads) != (nbytes, fmt, num_heads):
                return CONFLICT, None, None
            # parts are sorted and disjoint: only the neighbours of lo can overlap [lo, hi)
            i = bisect.bisect_left(obj.parts, lo, key=lambda p: p.lo)
            for p in obj.parts[max(0, i - 1):i + 1]:
                if p.lo < hi and lo < p.hi:
                    return (BUSY if (p.lo, p.hi) == (lo, hi) else CONFLICT), None, None
        if self._pending_by.get(owner, 0) >= self.max_pending or obj is None and not self._may_hold(owner, nbytes):
            return LIMIT, None, None
        if obj is None:
            obj = self._new_slot(Obj(key, -1, nbytes, fmt, owner, 0, now + lease_s, num_heads=num_heads,
                                     parts=[], by_token={}))
            if obj is None:
                return FULL, None, None
        else:
            self._pending_by[owner] = self._pending_by.get(owner, 0) + 1
            obj.deadline = max(obj.deadline, now + lease_s)
        part = Part(lo, hi, owner, next(self._tokens))
        bisect.insort(obj.parts, part, key=lambda p: p.lo)
        obj.by_token[part.token] = part
        return RESERVED, obj, part

    def commit(self, key: bytes, token: int, crc: int, owner: int) -> bool:
        """Make a reservation readable (a part: written; the object is readable once its
        parts cover every head); False (nothing changes) if ``token`` is not the key's
        live reservation by ``owner`` (it lapsed, was committed already, or was never
        this client's)."""
        obj = self._pending.get(key)
        if obj is None:
            return False
        if obj.parts is not None:
            part = self._part(obj, token, owner)
            if part is None or part.committed:
                return False
            part.committed, part.crc = True, crc
            obj.covered += part.hi - part.lo
            if obj.covered == obj.num_heads:  # parts never overlap: every head once
                obj.crc = [[p.lo, p.hi, p.crc] for p in obj.parts]
                self._publish(obj)
            return True
        if obj.token != token or obj.owner != owner:
            return False
        obj.crc = crc
        self._publish(obj)
        return True

    def abort(self, key: bytes, token: int, owner: int) -> bool:
        """Give a reservation up (a part: the whole object, which can no longer complete)."""
        obj = self._pending.get(key)
        if obj is None:
            return False
        if obj.parts is not None:
            part = self._part(obj, token, owner)
            if part is None:
                return False
        elif obj.token != token or obj.owner != owner:
            return False
        self._unreserve(obj)
        return True

    def reserve_spare(self, owner: int, now: float, lease_s: float, *, evict: bool = True, nbytes: int | None = None):
        """``(RESERVED, obj)``: a chunk for an object of ``nbytes`` (default: the largest)
        held for ``owner`` under no key until ``now + lease_s`` (``obj.offset``;
        :meth:`commit_spare` names ``obj.token``); else ``(FULL | LIMIT, None)``. It counts
        against ``max_pending`` like a reservation. ``evict``: evict as a reservation does
        (none free; above the watermark); else only a free chunk will do, and the bytes in
        use may pass the watermark (the next reservation evicts back to it): a spare asked
        for ahead of need never costs an object."""
        nbytes = self.slot_bytes if nbytes is None else nbytes
        if not self.fits(nbytes):
            raise ValueError(f"object of {nbytes} bytes exceeds the largest this node holds ({self.slot_bytes} B)")
        if self._pending_by.get(owner, 0) >= self.max_pending or not self._may_hold(owner, nbytes, spare=True):
            return LIMIT, None
        obj = Obj(b"", -1, nbytes, "", owner, next(self._tokens), now + lease_s)
        if not (self._place(obj) if evict else self._place_free(obj)):
            return FULL, None
        self._charge(obj, spare=True)
        self._spares[obj.token] = obj
        self._pending_by[owner] = self._pending_by.get(owner, 0) + 1
        return RESERVED, obj

    def commit_spare(self, key: bytes, token: int, nbytes: int, fmt: str, crc, owner: int, now: float) -> int:
        """Make what ``owner`` wrote into its spare ``token`` the readable object ``key``.

        COMMITTED: done (the spare is used up); PRESENT: ``key`` is committed already (its
        recency is refreshed; the spare, if any, stays ``owner``'s); NO_SPARE: ``token``
        is no live spare of ``owner`` (lapsed, used, or never its: nothing changes);
        BUSY: another reservation of ``key`` is live (the spare stays)."""
        if not self.fits(nbytes):
            raise ValueError(f"object of {nbytes} bytes exceeds the largest this node holds ({self.slot_bytes} B)")
        if key in self._objects:
            self._touch(self._objects[key])
            return PRESENT
        if self.elsewhere is not None and self.elsewhere(key):
            return PRESENT
        spare = self._spares.get(token)
        if spare is None or spare.owner != owner or chunk_bytes(nbytes) != chunk_bytes(spare.nbytes):
            return NO_SPARE
        if spare.deadline <= now:
            self._drop_spare(spare)
            return NO_SPARE
        obj = self._pending.get(key)
        if obj is not None:
            if obj.deadline > now:
                return BUSY
            self._unreserve(obj)
        del self._spares[token]
        self._uncharge(spare)
        self.alloc.resize(spare.offset, nbytes)
        spare.key, spare.nbytes, spare.fmt, spare.crc = key, nbytes, fmt, crc
        self._pending[key] = spare
        self._publish(spare)
        return COMMITTED

    # ---- objects the node fills itself (read back from a second tier) -------------------
    def stage(self, key: bytes, nbytes: int, fmt: str):
        """A pending object of no client (owner 0, no lease) in a chunk free now, for the
        node to fill; None when no chunk is free (:meth:`make_room`, then retry). Until
        :meth:`publish_staged` it is invisible, as a reservation is."""
        obj = Obj(key, -1, nbytes, fmt, 0, next(self._tokens), float("inf"))
        if key in self._pending or key in self._objects or not self._place_free(obj):
            return None
        self._pending[key] = obj
        self._pending_by[0] = self._pending_by.get(0, 0) + 1
        return obj

    def publish_staged(self, obj: Obj, crc) -> None:
        """Make staged ``obj`` readable with checksum ``crc`` (most recent)."""
        obj.crc = crc
        self._publish(obj)

    def pin_node(self, obj: Obj) -> None:
        """A pin of the node's own (no client, no lease): ``obj`` is not evicted until :meth:`unpin_node`."""
        self._pin(obj)

    def unpin_node(self, obj: Obj) -> None:
        self._unpin_obj(obj)

    def unstage(self, obj: Obj) -> None:
        """Give staged ``obj`` up (its chunk is freed)."""
        self._unreserve(obj)

    # ---- get -------------------------------------------------------------------------
    def get(self, key: bytes, fmt: str, owner: int, now: float, lease_s: float, *, nbytes: int | None = None):
        """``(obj, pin_id)`` for a committed object of this ``fmt`` (pinned until
        :meth:`release`; recency refreshed), ``(None, 0)`` for a miss, ``(None, -1)`` when
        ``owner`` holds ``max_pins`` pins already. ``nbytes``: the size ``fmt`` names; an
        object of another size is bad: dropped at once (counted in ``bad``), a miss."""
        obj = self._objects.get(key)
        if obj is None or obj.fmt != fmt:
            self.misses += 1
            return None, 0
        if nbytes is not None and obj.nbytes != nbytes:
            self.misses += 1
            self.bad += 1
            self._remove(obj)
            return None, 0
        if self._pins_by.get(owner, 0) >= self.max_pins:
            return None, -1
        self._touch(obj)
        self.hits += 1
        self._pin(obj)
        pin_id = next(self._tokens)
        self._pins[pin_id] = _Pin(obj, owner, now + lease_s)
        self._pins_by[owner] = self._pins_by.get(owner, 0) + 1
        return obj, pin_id

    def release(self, pin_id: int, owner: int, *, bad: bool = False) -> bool:
        """End a pin; ``bad``: its reader found the bytes wrong, so the object leaves the
        index (later gets miss). False if the pin is unknown or not ``owner``'s."""
        pin = self._pins.get(pin_id)
        if pin is None or pin.owner != owner:
            return False
        self._unpin(pin_id, pin)
        if bad and not pin.obj.dropped and self._objects.get(pin.obj.key) is pin.obj:
            self.bad += 1
            self._remove(pin.obj)
        return True

    # ---- housekeeping ----------------------------------------------------------------
    def expire(self, now: float) -> int:
        """Drop lapsed reservations, spares and pins; return how many."""
        gone = [o for o in self._pending.values() if o.deadline <= now]
        for obj in gone:
            self._unreserve(obj)
        spares = [o for o in self._spares.values() if o.deadline <= now]
        for obj in spares:
            self._drop_spare(obj)
        pins = [(i, p) for i, p in self._pins.items() if p.deadline <= now]
        for pin_id, pin in pins:
            self._unpin(pin_id, pin)
        return len(gone) + len(spares) + len(pins)

    def identify(self, owner: int, identity) -> None:
        """Client ``owner``'s reservations and spares count against ``identity``'s quota
        (several connections of one client share it); until told, each owner is its own."""
        self.holdings.identify(owner, identity)

    def identity_of(self, owner: int):
        """The identity :meth:`identify` gave ``owner`` (None: none yet)."""
        return self.holdings.identity_of(owner)

    def forget_owner(self, owner: int) -> None:
        """A client left: end its reservations (the multi-part objects where it holds an
        uncommitted part: whole; its committed parts stay until their object completes
        or lapses), its spares and its pins."""
        for obj in [o for o in self._pending.values() if self._holds_open(o, owner)]:
            self._unreserve(obj)
        for obj in [o for o in self._spares.values() if o.owner == owner]:
            self._drop_spare(obj)
        for pin_id, pin in [(i, p) for i, p in self._pins.items() if p.owner == owner]:
            self._unpin(pin_id, pin)
        self._pending_by.pop(owner, None)
        self._pins_by.pop(owner, None)
        self.holdings.forget(owner)

    def clear(self) -> None:
        """Drop every committed object nobody pins (pinned ones go at their last release)."""
        for obj in list(self._objects.values()):
            self._remove(obj)

    # ---- internals -------------------------------------------------------------------
    def _evict(self, obj: Obj, *, hold: bool) -> None:
        """Evict committed, unpinned ``obj`` (counted); a second tier's ``on_evict`` sees it
        first and, with ``hold``, may keep its chunk (see the module doc)."""
        if self.on_evict is not None and self.on_evict(obj, hold):
            self.held_bytes += chunk_bytes(obj.nbytes)
        self._remove(obj)
        self.evictions += 1

    def unhold(self, obj: Obj) -> None:
        """``on_evict`` is done with the chunk it kept (freed unless ``obj`` is back in the
        index, :meth:`readmit`, or pinned by readers)."""
        self.held_bytes -= chunk_bytes(obj.nbytes)
        self._unpin_obj(obj)

    def readmit(self, obj: Obj) -> None:
        """Put evicted ``obj``, whose chunk is still held, back as the most recent object
        (a get came for it while a second tier was taking it)."""
        obj.dropped = False
        self._objects[obj.key] = obj
        if obj.pins == 0:
            self._lru[obj.key] = obj
        if self.mirror is not None:
            self.mirror.add(obj.key)
        self.bytes_used += obj.nbytes

    def _evict_lru(self) -> bool:
        """Ahead of need (above the watermark): the LRU unpinned object goes, unless a
        second tier asks to wait (``can_hold`` false: its write-back queue is full; the
        trim goes on as it drains, :meth:`trim`). O(1): pinned objects are not in the list."""
        obj = next(iter(self._lru.values()), None)
        if obj is None or (self.can_hold is not None and not self.can_hold(obj)):
            return False
        self._evict(obj, hold=True)
        return True

    def _evict_for(self, nbytes: int) -> bool:
        """Evict what a chunk for ``nbytes`` needs now (:func:`~kvxfer.store.alloc.victims_for`);
        False: nothing can go."""
        victims = victims_for(self.alloc, self._lru.values(), nbytes, _evictable)
        for obj in victims:
            self._evict(obj, hold=False)
        return bool(victims)

    def make_room(self, nbytes: int) -> bool:
        """Evict, ahead of need, what a chunk for ``nbytes`` needs (a second tier may hold
        the chunks a while: retry the allocation as they come back); False: nothing can
        go, or not yet (``can_hold`` says wait)."""
        victims = victims_for(self.alloc, self._lru.values(), nbytes, _evictable)
        if not victims or (self.can_hold is not None and not all(self.can_hold(o) for o in victims)):
            return False
        for obj in victims:
            self._evict(obj, hold=True)
        return True

    def _remove(self, obj: Obj) -> None:
        """Take a committed object out of the index; free its chunk unless pinned."""
        del self._objects[obj.key]
        if self._lru.get(obj.key) is obj:
            del self._lru[obj.key]
        if self.mirror is not None:
            self.mirror.remove(obj.key)
        self.bytes_used -= obj.nbytes
        obj.dropped = True
        if obj.pins == 0:
            self.alloc.free(obj.offset)

    def _unpin(self, pin_id: int, pin: _Pin) -> None:
        del self._pins[pin_id]
        self._pins_by[pin.owner] -= 1
        self._unpin_obj(pin.obj)

    def _touch(self, obj: Obj) -> None:
        """``obj`` (committed) was used now: most recent."""
        self._objects.move_to_end(obj.key)
        if obj.key in self._lru:
            self._lru.move_to_end(obj.key)

    def _pin(self, obj: Obj) -> None:
        obj.pins += 1
        if obj.pins == 1 and self._lru.get(obj.key) is obj:
            del self._lru[obj.key]  # not evictable while pinned

    def _unpin_obj(self, obj: Obj) -> None:
        """One pin of ``obj`` ends: at the last, its chunk is freed if it left the index
        meanwhile, else it is evictable again (most recent: it was just read)."""
        obj.pins -= 1
        if obj.pins:
            return
        if obj.dropped:
            self.alloc.free(obj.offset)
        elif obj.committed and self._objects.get(obj.key) is obj:
            self._lru[obj.key] = obj

    def _place(self, obj: Obj) -> bool:
        """Give ``obj`` a chunk, evicting for it if none is free, then trim to the
        watermark; False when nothing can be evicted."""
        while True:
            off = self.alloc.alloc(obj.nbytes, obj)
            if off is not None:
                obj.offset = off
                self._trim()
                return True
            if not self._evict_for(obj.nbytes):
                return False

    def _place_free(self, obj: Obj) -> bool:
        """Give ``obj`` a free chunk, evicting nothing."""
        off = self.alloc.alloc(obj.nbytes, obj)
        if off is None:
            return False
        obj.offset = off
        return True

    def _new_slot(self, obj: Obj) -> Obj | None:
        """Give pending ``obj`` a chunk (evicting if none is free); None when full."""
        if not self._place(obj):
            return None
        self._charge(obj)
        self._pending[obj.key] = obj
        self._pending_by[obj.owner] = self._pending_by.get(obj.owner, 0) + 1
        return obj

    def trim(self) -> None:
        """Evict ahead of need down to the watermark (after a second tier's queue drained)."""
        self._trim()

    def _trim(self) -> None:
        """Evict LRU objects while the chunk bytes in use (less those held) exceed the watermark."""
        while self.alloc.bytes_allocated - self.held_bytes > self.watermark and self._evict_lru():
            pass

    def _may_hold(self, owner: int, nbytes: int, *, spare: bool = False) -> bool:
        return self.holdings.may_hold(owner, chunk_bytes(nbytes), spare=spare)

    def _charge(self, obj: Obj, *, spare: bool = False) -> None:
        obj.charge = self.holdings.charge(obj.owner, chunk_bytes(obj.nbytes), spare=spare)

    def _uncharge(self, obj: Obj) -> None:
        self.holdings.uncharge(obj.charge)
        obj.charge = None

    def _drop_spare(self, obj: Obj) -> None:
        del self._spares[obj.token]
        self._uncharge(obj)
        left = self._pending_by.get(obj.owner)
        if left is not None:
            self._pending_by[obj.owner] = left - 1
        self.alloc.free(obj.offset)

    @staticmethod
    def _part(obj: Obj, token: int, owner: int) -> Part | None:
        p = obj.by_token.get(token)
        return p if p is not None and p.owner == owner else None

    @staticmethod
    def _holds_open(obj: Obj, owner: int) -> bool:
        if obj.parts is None:
            return obj.owner == owner
        return any(p.owner == owner and not p.committed for p in obj.parts)

    def _publish(self, obj: Obj) -> None:
        self._drop_pending(obj)
        obj.committed = True
        self._objects[obj.key] = obj
        if obj.pins == 0:
            self._lru[obj.key] = obj
        if self.mirror is not None:
            self.mirror.add(obj.key)
        self.bytes_used += obj.nbytes

    def _drop_pending(self, obj: Obj) -> None:
        del self._pending[obj.key]
        self._uncharge(obj)
        for owner in ([obj.owner] if obj.parts is None else [p.owner for p in obj.parts]):
            left = self._pending_by.get(owner)
            if left is not None:  # None: the client left (forget_owner) meanwhile
                self._pending_by[owner] = left - 1

    def _unreserve(self, obj: Obj) -> None:
        self._drop_pending(obj)
        self.alloc.free(obj.offset)
