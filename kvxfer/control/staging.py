"""A first-fit allocator over one registered staging buffer.

D grants pack chunks a slice of its ring; P packs into its own. Requests that do
not fit wait in FIFO order and are granted as slices are freed, so a burst of
large transfers queues instead of failing. Offsets are 256-byte aligned.
"""
from __future__ import annotations

import threading

ALIGN = 256


class StagingRing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[list[int]] = [[0, capacity]]  # sorted [offset, size]
        self._used: dict[int, int] = {}  # offset -> size
        self._waiting: list = []  # (nbytes, callback(offset))
        self._cond = threading.Condition()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return sum(self._used.values())

    def _try_alloc(self, nbytes: int) -> int | None:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = [off + size, free - size]
                self._used[off] = size
                return off
        return None

    def alloc(self, nbytes: int, timeout: float | None = None) -> int | None:
        """Block until ``nbytes`` fit (None after ``timeout``); ValueError if they never can."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} B exceeds the staging capacity of {self.capacity} B")
        got: list = []

        def attempt() -> bool:
            if self._closed:
                return True
            off = None if self._waiting else self._try_alloc(nbytes)
            if off is not None:
                got.append(off)
            return off is not None

        with self._cond:
            self._cond.wait_for(attempt, timeout)
            return got[0] if got else None

    def alloc_async(self, nbytes: int, callback) -> None:
        """Call ``callback(offset)`` now or once space frees (FIFO); may run on the freeing thread."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} B exceeds the staging capacity of {self.capacity} B")
        with self._cond:
            off = None if self._waiting else self._try_alloc(nbytes)
            if off is None:
                self._waiting.append((nbytes, callback))
                return
        callback(off)

    def free(self, offset: int) -> None:
        ready = []
        with self._cond:
            size = self._used.pop(offset)
            self._free.append([offset, size])
            self._free.sort()
            merged = [self._free[0]]
            for off, n in self._free[1:]:
                if merged[-1][0] + merged[-1][1] == off:
                    merged[-1][1] += n
                else:
                    merged.append([off, n])
            self._free = merged
            while self._waiting:
                got = self._try_alloc(self._waiting[0][0])
                if got is None:
                    break
                ready.append((self._waiting.pop(0)[1], got))
            self._cond.notify_all()
        for callback, off in ready:
            callback(off)

    def close(self) -> None:
        """Wake every blocked :meth:`alloc` (it returns None) and drop queued requests."""
        with self._cond:
            self._closed = True
            self._waiting.clear()
            self._cond.notify_all()

