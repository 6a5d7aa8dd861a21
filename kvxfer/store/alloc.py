"""``ChunkAllocator``: one capacity shared by objects of several sizes (size classes).

A store node holds objects of whatever sizes its clients' models make (a 7B and a 70B
model, a TP group's whole objects) in one buffer (DRAM) or one file (the disk tier).
The capacity is cut into **pages** of ``page_bytes``: :data:`PAGE_OBJECTS` chunks of the
largest object the node takes (down to half as many where that covers more of a small
capacity, fewer where the capacity holds fewer). A page is free
until a chunk of it is asked for; from then on it holds chunks of one size, its
**class**, and it goes back to the free pages when its last chunk is freed, so a class
grows where another shrank.

An object of ``n`` bytes takes a chunk of :func:`chunk_bytes` ``(n)``: ``n`` rounded up to
:data:`ALIGN_LARGE` (4 KiB, so that the disk tier reads and writes large objects in place
with direct I/O) from :data:`LARGE` bytes up, to :data:`ALIGN_SMALL` (a cache line) below.
A page of class ``c`` holds ``floor(page_bytes / c)`` chunks, at least
:data:`PAGE_OBJECTS`, and leaves a tail of fewer than ``c`` bytes unused. So what
rounding takes is less than one chunk a page (under ``1 / (PAGE_OBJECTS + 1)`` of the
page) plus the alignment of each chunk (under 1/16 of an object of 64 KiB or more;
under 64 bytes otherwise); :attr:`ChunkAllocator.rounding_bytes` counts both.

The allocator places chunks; which object to evict when nothing is free is its owner's
policy (:class:`~kvxfer.store.index.SlotIndex`, :class:`~kvxfer.store.disk.DiskTier`),
which :meth:`ChunkAllocator.page_owners` and :meth:`ChunkAllocator.class_of` serve. Offsets
are bytes from the start of the buffer or file. Not thread-safe (its owner's thread).
"""
from __future__ import annotations

__all__ = ["ChunkAllocator", "chunk_bytes", "victims_for", "ALIGN_LARGE", "ALIGN_SMALL", "LARGE", "PAGE_OBJECTS"]

ALIGN_LARGE = 4096
ALIGN_SMALL = 64
LARGE = 64 << 10
PAGE_OBJECTS = 8


def chunk_bytes(nbytes: int) -> int:
    """The chunk an object of ``nbytes`` takes (its class): rounded up to
    :data:`ALIGN_LARGE` from :data:`LARGE` bytes, else to :data:`ALIGN_SMALL`."""
    align = ALIGN_LARGE if nbytes >= LARGE else ALIGN_SMALL
    return -(-nbytes // align) * align


# an eviction for a chunk of another class looks at this many LRU objects and pages at most
SCAN_OBJECTS, SCAN_PAGES = 4096, 64


def victims_for(alloc: "ChunkAllocator", lru, nbytes: int, can_go) -> list:
    """The eviction policy of both tiers when a chunk for ``nbytes`` is needed now and
    ``alloc`` has none: the objects to evict, ``[]`` if none will do.

    ``lru``: the owner's objects, least recently used first (each with an ``offset``);
    ``can_go(obj)``: it may be evicted now (committed, unpinned). The first LRU object
    that can go is the victim if its chunk is of the class wanted; else every object of
    the page holding it, if all of them can go (the page then takes the new class).
    """
    want, page_bytes = chunk_bytes(nbytes), alloc.page_bytes
    seen: set = set()  # pages passed over
    for scanned, obj in enumerate(lru):
        if scanned >= SCAN_OBJECTS or len(seen) >= SCAN_PAGES:
            break
        if not can_go(obj):
            continue
        if alloc.class_of(obj.offset) == want:
            return [obj]
        page = obj.offset // page_bytes
        if page in seen:
            continue
        seen.add(page)
        owners = alloc.page_owners(obj.offset)
        if all(can_go(o) for o in owners):
            return owners
    return []


class _Page:
    __slots__ = ("base", "chunk", "count", "owners", "free", "bump")

    def __init__(self, base: int) -> None:
        self.base = base
        self.chunk = 0  # its class (0: a free page)
        self.count = 0  # chunks it holds
        self.owners: dict = {}  # chunk index -> owner, for the chunks in use
        self.free: list = []  # chunk indexes freed (below bump)
        self.bump = 0  # chunks from here on were never handed out


class ChunkAllocator:
    """``ChunkAllocator(capacity_bytes, largest_bytes)``; see the module doc.

    ``largest_bytes``: the largest object it must hold (objects up to it fit).
    ``region_bytes`` (whole pages, at most ``capacity_bytes``) is what the buffer or
    file needs; ``num_pages`` pages of ``page_bytes``.
    """

    def __init__(self, capacity_bytes: int, largest_bytes: int, *, page_objects: int = PAGE_OBJECTS) -> None:
        for label, value in (("capacity_bytes", capacity_bytes), ("largest_bytes", largest_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an int >= 1, got {value!r}")
        self.largest = largest_bytes
        big = chunk_bytes(largest_bytes)
        if capacity_bytes < big:
            raise ValueError(f"a capacity of {capacity_bytes} B holds no object of {largest_bytes} B "
                             f"(a chunk of {big} B)")
        # pages of k largest chunks: of the k that keep at least half the page_objects (where
        # the capacity holds that many), the one whose whole pages cover most of it
        most = max(1, min(page_objects, capacity_bytes // big))
        k = max(range(max(1, most // 2), most + 1), key=lambda k: (capacity_bytes // (k * big) * k, k))
        self.page_bytes = big * k
        self.num_pages = capacity_bytes // self.page_bytes
        self.region_bytes = self.num_pages * self.page_bytes
        self._pages = [_Page(i * self.page_bytes) for i in range(self.num_pages)]
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # a stack: low pages first
        self._partial: dict[int, dict] = {}  # class -> {page index: page} with a free chunk
        self.bytes_allocated = 0  # chunk bytes in use
        self.bytes_requested = 0  # object bytes in those chunks
        self.tail_bytes = 0  # the unused tails of pages in use
        self.chunks_used = 0
        self._sizes: dict[int, int] = {}  # offset -> bytes asked for (the owner's object)
        self._stale = False  # claims since the last _fresh()

    # ---- queries -------------------------------------------------------------------------
    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.largest

    @property
    def pages_used(self) -> int:
        if self._stale:
            self._fresh()
        return self.num_pages - len(self._free_pages)

    @property
    def rounding_bytes(self) -> int:
        """Bytes lost to rounding now: chunks past their objects' ends, and page tails."""
        return self.bytes_allocated - self.bytes_requested + self.tail_bytes

    def class_of(self, offset: int) -> int:
        """The chunk size of the page holding ``offset`` (0: a free page)."""
        return self._pages[offset // self.page_bytes].chunk

    def owner_at(self, offset: int):
        page = self._pages[offset // self.page_bytes]
        return page.owners.get((offset - page.base) // page.chunk) if page.chunk else None

    def page_owners(self, offset: int) -> list:
        """The owners of every chunk in use in the page holding ``offset``."""
        return list(self._pages[offset // self.page_bytes].owners.values())

    def can_alloc(self, nbytes: int) -> bool:
        """:meth:`alloc` would succeed now."""
        if self._stale:
            self._fresh()
        return bool(self._partial.get(chunk_bytes(nbytes))) or bool(self._free_pages)

    # ---- changes ---------------------------------------------------------------------------
    def alloc(self, nbytes: int, owner) -> int | None:
        """The offset of a chunk for an object of ``nbytes`` (held for ``owner``), from a
        page of its class with a free chunk, else a free page; None when neither exists."""
        if not self.fits(nbytes):
            raise ValueError(f"an object of {nbytes} B exceeds the largest this allocator holds ({self.largest} B)")
        if self._stale:
            self._fresh()
        chunk = chunk_bytes(nbytes)
        partial = self._partial.get(chunk)
        if partial:
            page = next(iter(partial.values()))
        elif self._free_pages:
            page = self._assign(self._free_pages.pop(), chunk)
        else:
            return None
        i = page.free.pop() if page.free else page.bump
        if i == page.bump:
            page.bump += 1
        self._take(page, i, nbytes, owner)
        return page.base + i * chunk

    def claim(self, offset: int, nbytes: int, owner) -> bool:
        """Hold the chunk at ``offset`` for an object of ``nbytes`` (recovery of the disk
        tier: the chunks its records name, before any :meth:`alloc`); False if that cannot
        be: outside the pages, not a chunk boundary of its page's class, or in use."""
        if not self.fits(nbytes) or not 0 <= offset < self.region_bytes:
            return False
        chunk = chunk_bytes(nbytes)
        page = self._pages[offset // self.page_bytes]
        if page.chunk == 0:
            page.chunk, page.count = chunk, self.page_bytes // chunk
            self.tail_bytes += self.page_bytes - page.count * chunk
            self._stale = True  # the free pages, free chunks and partial pages are rebuilt once
        if page.chunk != chunk or (offset - page.base) % chunk:
            return False
        i = (offset - page.base) // chunk
        if i >= page.count or i in page.owners:
            return False
        page.bump = max(page.bump, i + 1)
        page.owners[i] = owner
        self.bytes_allocated += chunk
        self.bytes_requested += nbytes
        self._sizes[offset] = nbytes
        self.chunks_used += 1
        return True

    def resize(self, offset: int, nbytes: int) -> None:
        """The chunk at ``offset`` now holds an object of ``nbytes`` (of the same class)."""
        self.bytes_requested += nbytes - self._sizes[offset]
        self._sizes[offset] = nbytes

    def set_owner(self, offset: int, owner) -> None:
        page = self._pages[offset // self.page_bytes]
        page.owners[(offset - page.base) // page.chunk] = owner

    def free(self, offset: int) -> None:
        """Give the chunk at ``offset`` back (its page too, if it was the last in use)."""
        if self._stale:
            self._fresh()
        index = offset // self.page_bytes
        page = self._pages[index]
        i = (offset - page.base) // page.chunk
        del page.owners[i]
        self.bytes_allocated -= page.chunk
        self.bytes_requested -= self._sizes.pop(offset)
        self.chunks_used -= 1
        if not page.owners:  # the page is free again, for any class
            self._partial.get(page.chunk, {}).pop(index, None)
            self.tail_bytes -= self.page_bytes - page.count * page.chunk
            page.chunk = page.count = page.bump = 0
            page.free = []
            self._free_pages.append(index)
            return
        page.free.append(i)
        self._partial.setdefault(page.chunk, {})[index] = page

    def stats(self) -> dict:
        return {"pages": self.num_pages, "pages_used": self.pages_used, "page_bytes": self.page_bytes,
                "bytes_allocated": self.bytes_allocated, "rounding_bytes": self.rounding_bytes,
                "classes": len({p.chunk for p in self._pages if p.chunk})}

    # ---- internals -----------------------------------------------------------------------
    def _fresh(self) -> None:
        """After claims: rebuild the free pages, each page's free chunks and the partial pages."""
        self._stale = False
        self._free_pages, self._partial = [], {}
        for index in range(self.num_pages - 1, -1, -1):
            page = self._pages[index]
            if page.chunk == 0:
                self._free_pages.append(index)
                continue
            page.free = [i for i in range(page.bump - 1, -1, -1) if i not in page.owners]
            if len(page.owners) < page.count:
                self._partial.setdefault(page.chunk, {})[index] = page

    def _assign(self, index: int, chunk: int) -> _Page:
        page = self._pages[index]
        page.chunk, page.count, page.bump = chunk, self.page_bytes // chunk, 0
        self.tail_bytes += self.page_bytes - page.count * chunk
        self._partial.setdefault(chunk, {})[index] = page
        return page

    def _take(self, page: _Page, i: int, nbytes: int, owner) -> None:
        page.owners[i] = owner
        if len(page.owners) == page.count:
            self._partial[page.chunk].pop(page.base // self.page_bytes, None)
        self.bytes_allocated += page.chunk
        self.bytes_requested += nbytes
        self._sizes[page.base + i * page.chunk] = nbytes
        self.chunks_used += 1
