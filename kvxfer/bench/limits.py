"""Physical limits, measured in the same run as the results they bound.

- :class:`MemcpyLimit` / :func:`memcpy_seconds`: one thread copying N bytes between
  two buffers of this process with libc ``memcpy`` (``ctypes.memmove``). Single-threaded on purpose:
  a same-host transfer (UCX cma, ``process_vm_writev``) is one thread copying too.
  ``torch`` copies are avoided because torch splits large copies over its thread
  pool, which would make the limit depend on ``torch.get_num_threads()``.
- :class:`SocketLimit`: a plain TCP socket on loopback between two processes,
  N bytes per message, each acknowledged, the limit a TCP transport is held to.

Every sample is one timed repetition in seconds; warm-up repetitions are run and
discarded here, so callers get steady-state samples only.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import socket
import struct
import time

from ..errors import PeerDisconnected, TransferTimeout

_HDR = struct.Struct("!Q")  # message length; 0 asks the peer to exit


def _buffer(nbytes: int):
    """A page-aligned, pre-faulted byte buffer.

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


def _call_overhead(dst_ptr: int, src_ptr: int, reps: int) -> float:
    """Seconds per ``memmove`` call spent in Python/ctypes (a zero-byte copy), median of 5."""
    per_call = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            ctypes.memmove(dst_ptr, src_ptr, 0)
        per_call.append((time.perf_counter() - t0) / reps)
    return sorted(per_call)[2]


class MemcpyLimit:
    """Two page-aligned, pre-faulted buffers of ``nbytes`` kept for a whole measurement,
    so limit samples can be taken *between* the transfers they bound (interleaved: load
    from other processes and the host's memory bandwidth drift hit both alike).

    Copies below 4 MiB are repeated inside one sample (the clock cannot resolve a
    4 KiB copy) and the measured cost of the Python call itself is subtracted, so a
    small copy's figure is libc's, not the interpreter's. Buffers are reused, as the
    transfers they bound reuse theirs, so caches are equally warm on both sides.
    """

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self.nbytes = nbytes
        self._src, self._dst = _buffer(nbytes), _buffer(nbytes)
        self._src_ptr, self._dst_ptr = self._src.ctypes.data, self._dst.ctypes.data
        self._reps = max(1, (4 << 20) // nbytes)
        self._overhead = _call_overhead(self._dst_ptr, self._src_ptr, self._reps) if self._reps > 1 else 0.0

    def sample(self) -> float:
        """Seconds for one single-thread ``memcpy`` of ``nbytes``."""
        t0 = time.perf_counter()
        for _ in range(self._reps):
            ctypes.memmove(self._dst_ptr, self._src_ptr, self.nbytes)
        return max((time.perf_counter() - t0) / self._reps - self._overhead, 1e-9)

    def seconds(self, iters: int, warmup: int = 2) -> list[float]:
        """``iters`` samples after ``warmup`` discarded ones."""
        if iters <= 0:
            raise ValueError("iters must be positive")
        for _ in range(warmup):
            self.sample()
        return [self.sample() for _ in range(iters)]


def memcpy_seconds(nbytes: int, iters: int, warmup: int = 2) -> list[float]:
    """Seconds per single-thread ``memcpy`` of ``nbytes`` (``iters`` samples, warm-up dropped);
    see :class:`MemcpyLimit`."""
    if nbytes <= 0 or iters <= 0:
        raise ValueError("nbytes and iters must be positive")
    return MemcpyLimit(nbytes).seconds(iters, warmup)


def _recv_exact(sock: socket.socket, view: memoryview, nbytes: int) -> None:
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:nbytes], nbytes - got)
        if n == 0:
            raise PeerDisconnected("socket peer closed")
        got += n


def _socket_sink(port: int) -> None:
    """Peer process: receive messages, acknowledge each with one byte."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1)
    hdr = bytearray(_HDR.size)
    try:
        while True:
            _recv_exact(sock, memoryview(hdr), _HDR.size)
            (nbytes,) = _HDR.unpack(hdr)
            if nbytes == 0:
                return
            if len(buf) < nbytes:
                buf = bytearray(nbytes)
            _recv_exact(sock, memoryview(buf), nbytes)
            sock.sendall(b"k")
    finally:
        sock.close()


class SocketLimit:
    """A TCP loopback peer process kept for a whole sweep; use as a context manager."""

    def __init__(self, timeout: float = 30.0):
        self.timeout = timeout
        self._proc = None
        self._sock: socket.socket | None = None

    def __enter__(self) -> "SocketLimit":
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(self.timeout)
        ctx = mp.get_context("spawn")
        self._proc = ctx.Process(target=_socket_sink, args=(listener.getsockname()[1],), daemon=True)
        self._proc.start()
        try:
            self._sock, _ = listener.accept()
        except socket.timeout as exc:
            self.close()
            raise TransferTimeout("socket limit peer did not connect") from exc
        finally:
            listener.close()
        self._sock.settimeout(self.timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def seconds(self, nbytes: int, iters: int, warmup: int = 2) -> list[float]:
        """Seconds per ``nbytes`` message delivered and acknowledged (warm-up dropped)."""
        if self._sock is None:
            raise RuntimeError("SocketLimit used outside its context")
        payload = memoryview(_buffer(nbytes))[:nbytes]
        ack = bytearray(1)
        samples = []
        try:
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                self._sock.sendall(_HDR.pack(nbytes))
                self._sock.sendall(payload)
                _recv_exact(self._sock, memoryview(ack), 1)
                if i >= warmup:
                    samples.append(time.perf_counter() - t0)
        except socket.timeout as exc:
            raise TransferTimeout(f"socket limit: no ack within {self.timeout}s") from exc
        return samples

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.sendall(_HDR.pack(0))
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
            self._proc = None

    def __exit__(self, *exc) -> None:
        self.close()
