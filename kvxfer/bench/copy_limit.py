"""The memcpy limit: the best contiguous copy of N bytes this machine does with the
resources the measured path uses, in native code, sampled in the same run.

``MemcpyLimit(nbytes, threads=T, streaming=S)`` copies between two page-aligned,
pre-faulted buffers of this process with :func:`kvxfer.kernels.contiguous_copy`:

- ``streaming=False``: glibc ``memcpy`` on T threads, each a contiguous 1/T of the
  bytes. glibc picks its own store kind per call (ordinary stores, non-temporal
  ones above its threshold), so this is the best libc does for the same thread count.
- ``streaming=True``: also the C++ tile copy over the bytes as T contiguous ranges with
  non-temporal (SSE2 streaming) stores, the store kind kvxfer's pack kernels and its
  same-host shared-memory path use for large batches; each sample takes the faster of
  the two store kinds, so the limit never drops below what glibc does.

Both split the bytes statically and start their helper threads per call, while
the measured paths keep a pool whose helpers take slices in turn, so on a busy
host a helper that is scheduled late stalls the limit's copy but not the path's.
Each sample therefore takes the faster of the T-thread copy and the same copy on
the calling thread alone (both within the path's resources); :attr:`MemcpyLimit.wins`
counts which one set each sample. Copies below 4 MiB are repeated inside one
sample (the clock cannot resolve a 4 KiB copy). Buffers are reused across samples, as the transfers they bound reuse
theirs, so caches are equally warm on both sides. :class:`~.resources.CopyResources`
says which T and S a path uses.

Where the bytes no longer fit the last-level cache between two uses (a benchmark that
touches other buffers between its timed calls), a back-to-back copy reads a source the
previous copy left in cache while the measured path reads memory: on a host with 32 MiB
of L3, a 32 MiB copy ran at 22.9 GB/s back to back and 19.6 GB/s from memory.
``MemcpyLimit(..., cold=True)`` flushes the caches (:class:`CacheFlusher`) before every
timed copy, and the benchmark flushes before each timed call of the path, so both start
from memory.
"""
from __future__ import annotations

import time

_REPEAT_BELOW = 4 << 20


def page_aligned(nbytes: int):
    """A page-aligned, pre-faulted ``uint8`` numpy buffer of ``nbytes`` (at least 1).

    Page alignment matters: two malloc'd buffers whose addresses differ by a few
    dozen bytes modulo 4 KiB hit 4K-aliasing in memcpy and measure 10x slow,
    while KV pools and staging buffers are page aligned.
    """
    import numpy as np

    page = 4096
    raw = np.empty(max(nbytes, 1) + page, dtype=np.uint8)
    start = (-raw.ctypes.data) % page
    buf = raw[start:start + max(nbytes, 1)]
    buf.fill(1)  # fault every page in before anything is timed
    return buf


def last_level_cache_bytes() -> int:
    """The largest CPU cache this host reports in sysfs (bytes; 64 MiB where it reports none)."""
    import glob

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu*/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        try:
            best = max(best, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return best or 64 << 20


class CacheFlusher:
    """``flush()`` reads one byte of every cache line of a buffer four times the
    last-level cache (at least 256 MiB, at most 2 GiB), so that what is read next comes
    from memory (a VM may report less cache than its host has). It reads, never writes:
    dirty lines left in the cache would be written back during the next timed copy (on a
    host with 32 MiB of L3 a written flush slowed a 32 MiB copy to 14.5 GB/s, a read one
    to 19.6)."""

    _shared: "CacheFlusher | None" = None

    def __init__(self) -> None:
        self.nbytes = min(max(4 * last_level_cache_bytes(), 256 << 20), 2 << 30)
        self._buf = page_aligned(self.nbytes)

    @classmethod
    def shared(cls) -> "CacheFlusher":
        """One flusher for the process (its buffer can be 2 GiB)."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def flush(self) -> None:
        int(self._buf[::64].sum())


class MemcpyLimit:
    """Seconds per native copy of ``nbytes`` on ``threads`` threads (see the module doc;
    ``cold=True``: each timed copy starts with the caches flushed)."""

    def __init__(self, nbytes: int, *, threads: int = 1, streaming: bool = False, cold: bool = False):
        from ..kernels import contiguous_copy

        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.nbytes, self.threads, self.streaming = nbytes, int(threads), bool(streaming)
        self._src, self._dst = page_aligned(nbytes), page_aligned(nbytes)
        self._reps = max(1, _REPEAT_BELOW // nbytes)
        dst, src = self._dst.ctypes.data, self._src.ctypes.data
        counts = sorted({self.threads, 1}, reverse=True)
        kinds = (False, True) if self.streaming else (False,)
        # T threads first, then the caller alone; libc's stores, then (streaming) non-temporal ones
        self._copies = [(f"{t}+nt" if nt else t, contiguous_copy(dst, src, nbytes, threads=t, streaming=nt))
                        for t in counts for nt in kinds]
        self.wins = {who: 0 for who, _ in self._copies}
        self.flusher = CacheFlusher.shared() if cold else None

    def _time(self, copy) -> float:
        if self.flusher is not None:
            self.flusher.flush()
        t0 = time.perf_counter()
        for _ in range(self._reps):
            copy()
        return max((time.perf_counter() - t0) / self._reps, 1e-9)

    def sample(self) -> float:
        """Seconds for one copy of ``nbytes``: the fastest of the T-thread and 1-thread copies."""
        best, who = min(((self._time(copy), who) for who, copy in self._copies), key=lambda x: x[0])
        self.wins[who] += 1
        return best

    def seconds(self, iters: int, warmup: int = 2) -> list[float]:
        """``iters`` samples after ``warmup`` discarded ones."""
        if iters <= 0:
            raise ValueError("iters must be positive")
        for _ in range(warmup):
            self.sample()
        return [self.sample() for _ in range(iters)]

    def check(self) -> bool:
        """True when the destination holds the source's bytes (the copy is not a no-op)."""
        import numpy as np

        pattern = np.random.default_rng(0).integers(0, 256, 4099, dtype=np.uint8)
        self._src[:] = np.resize(pattern, self.nbytes)
        ok = True
        for _, copy in self._copies:
            self._dst.fill(0)
            copy()
            ok &= bool(np.array_equal(self._src, self._dst))
        self._src.fill(1)
        return ok
