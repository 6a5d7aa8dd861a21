"""The endpoints of ``kvxfer bench transfer``: two sides of one kvxfer backend.

Each endpoint owns a page-aligned pool (``2 * batch`` slots of the largest block;
blocks are every other slot, so no two descriptors coalesce) and a staging
region (``batch`` blocks), both registered once through
``kvxfer.transport.make_backend(name)``. The initiator connects with the
target's :meth:`~kvxfer.transport.base.Backend.metadata` and posts.

Paths (one timed iteration each):

- ``zero-copy``: prepare = build the ``[batch, 5]`` descriptor array; post =
  ``Backend.post``; transfer = post until ``Backend.test`` is True (data visible).
- ``pack``: prepare = gather the blocks into the source's staging region (one
  thread); one descriptor moves the staging bytes; then the destination scatters
  them (counted in latency as ``unpack``). The agent's staging-grant round trip
  is not part of this microbenchmark.

Endpoints run in two spawned processes, or in this process for backends that
cannot cross processes (``loopback``). ``--check`` fills the source from a seed
before every iteration and the destination re-derives and compares every byte.
The hidden test hook ``KVXFER_BENCH_CORRUPT_BYTE=N`` flips byte N of the
destination before that comparison, to prove the check catches it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

from ..errors import KVXferError, PeerDisconnected, TransferTimeout

CORRUPT_ENV = "KVXFER_BENCH_CORRUPT_BYTE"
IN_PROCESS_BACKENDS = ("loopback",)


def make_backend(name: str):
    """A kvxfer backend by name: ``loopback`` (in-process, for tests) or whatever
    ``kvxfer.transport.make_backend`` builds (``auto``, ``ucx``, ``vm``)."""
    if name == "loopback":
        from ..transport.loopback import LoopbackBackend

        return LoopbackBackend()
    try:
        from ..transport import make_backend as factory
    except ImportError as exc:
        raise KVXferError(f"backend {name!r} unavailable: {exc}") from exc
    return factory(name)


def _pattern(seed: int, nbytes: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Endpoint:
    """One side: backend, registered pool + staging, and the commands the session sends."""

    def __init__(self, backend: str, slot_bytes: int, batch: int):
        from .limits import _buffer

        self.backend = make_backend(backend)
        self.pool = _buffer(2 * batch * slot_bytes)
        self.staging = _buffer(batch * slot_bytes)
        self.pool_rid = self.backend.register(self.pool.ctypes.data, self.pool.nbytes)
        self.staging_rid = self.backend.register(self.staging.ctypes.data, self.staging.nbytes)
        self.conn = None
        self.remote = (0, 0)

    # -- handshake
    def hello(self):
        return self.backend.metadata(), self.pool_rid, self.staging_rid

    def connect(self, metadata: bytes, pool_rid: int, staging_rid: int) -> str:
        self.conn = self.backend.connect(metadata)
        self.remote = (pool_rid, staging_rid)
        return self.conn.transport

    def per_desc_us(self) -> float:
        return self.backend.capabilities().per_desc_overhead_us

    # -- data
    def _slots(self, block_size: int, batch: int):
        return [self.pool[2 * i * block_size:(2 * i + 1) * block_size] for i in range(batch)]

    def fill(self, seed: int, block_size: int, batch: int) -> None:
        data = _pattern(seed, block_size * batch)
        for i, slot in enumerate(self._slots(block_size, batch)):
            slot[:] = data[i * block_size:(i + 1) * block_size]

    def verify(self, seed: int, block_size: int, batch: int) -> int | None:
        """Index (into the batch's bytes) of the first wrong byte, or None."""
        import numpy as np

        hook = os.environ.get(CORRUPT_ENV)
        if hook is not None:
            slot = self._slots(block_size, batch)[int(hook) // block_size]
            slot[int(hook) % block_size] ^= 0xFF
        want = _pattern(seed, block_size * batch)
        for i, slot in enumerate(self._slots(block_size, batch)):
            bad = np.flatnonzero(slot != want[i * block_size:(i + 1) * block_size])
            if bad.size:
                return i * block_size + int(bad[0])
        return None

    def gather(self, block_size: int, batch: int) -> float:
        t0 = time.perf_counter()
        for i, slot in enumerate(self._slots(block_size, batch)):
            self.staging[i * block_size:(i + 1) * block_size] = slot
        return time.perf_counter() - t0

    def scatter(self, block_size: int, batch: int) -> float:
        t0 = time.perf_counter()
        for i, slot in enumerate(self._slots(block_size, batch)):
            slot[:] = self.staging[i * block_size:(i + 1) * block_size]
        return time.perf_counter() - t0

    # -- timed transfers (initiator)
    def _run(self, op: str, descs, timeout: float) -> tuple[float, float]:
        t1 = time.perf_counter()
        req = self.backend.post(self.conn, op, descs)
        t2 = time.perf_counter()
        deadline = t2 + timeout
        while not self.backend.test(req):
            if time.perf_counter() > deadline:
                raise TransferTimeout(f"{op} not complete within {timeout}s")
        return t2 - t1, time.perf_counter() - t1

    def zero_copy(self, block_size: int, batch: int, op: str, timeout: float) -> dict:
        import numpy as np

        t0 = time.perf_counter()
        offs = np.arange(batch, dtype=np.int64) * (2 * block_size)
        descs = np.empty((batch, 5), dtype=np.int64)
        descs[:, 0], descs[:, 1] = self.pool_rid, offs
        descs[:, 2], descs[:, 3], descs[:, 4] = self.remote[0], offs, block_size
        prepare = time.perf_counter() - t0
        post, transfer = self._run(op, descs, timeout)
        return {"prepare_s": prepare, "post_s": post, "transfer_s": transfer}

    def staged(self, nbytes: int, op: str, timeout: float) -> dict:
        import numpy as np

        descs = np.array([[self.staging_rid, 0, self.remote[1], 0, nbytes]], dtype=np.int64)
        post, transfer = self._run(op, descs, timeout)
        return {"post_s": post, "transfer_s": transfer}

    def close(self) -> None:
        if self.conn is not None:
            self.backend.disconnect(self.conn)
            self.conn = None
        self.backend.close()


def _serve(conn, backend: str, slot_bytes: int, batch: int) -> None:
    """Spawned endpoint: run commands from the pipe until ``stop``."""
    try:
        ep = Endpoint(backend, slot_bytes, batch)
        conn.send(("ok", None))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    progress = getattr(ep.backend, "progress", None)
    try:
        while True:
            # A target must keep progressing for transports that emulate RMA (UCX am-rma,
            # tcp). It naps 0.5 ms between progress calls instead of spinning: on a small
            # shared machine a spinning target takes the core the initiator needs (measured
            # on 2 cores: spinning while busy gave 0.1-0.7x the socket at 4 KiB, napping
            # 0.45-0.5x); fully one-sided paths (vm, cma) never need it.
            while progress is not None:
                if conn.poll(0.0005):
                    break
                progress()  # drains what arrived (the engine loops until UCX is idle)
            cmd, args = conn.recv()
            if cmd == "stop":
                return
            try:
                conn.send(("ok", getattr(ep, cmd)(*args)))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except (EOFError, OSError):
        return
    finally:
        ep.close()


class _Spawned:
    def __init__(self, ctx, backend: str, slot_bytes: int, batch: int, timeout: float):
        self.timeout = timeout
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, backend, slot_bytes, batch), daemon=True)
        self.proc.start()
        self._reply("start")

    def _reply(self, what: str):
        if not self.pipe.poll(self.timeout):
            raise TransferTimeout(f"bench endpoint did not answer {what!r} within {self.timeout}s")
        try:
            status, value = self.pipe.recv()
        except EOFError as exc:
            raise PeerDisconnected("bench endpoint process exited") from exc
        if status == "error":
            raise KVXferError(f"bench endpoint: {value}")
        return value

    def call(self, cmd: str, *args):
        self.pipe.send((cmd, args))
        return self._reply(cmd)

    def close(self) -> None:
        try:
            self.pipe.send(("stop", ()))
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


class _Local:
    def __init__(self, backend: str, slot_bytes: int, batch: int):
        self.ep = Endpoint(backend, slot_bytes, batch)

    def call(self, cmd: str, *args):
        return getattr(self.ep, cmd)(*args)

    def close(self) -> None:
        self.ep.close()


class _Remote:
    """An endpoint on another host, started by ``kvxfer bench transfer --listen``."""

    def __init__(self, address: str, backend: str, slot_bytes: int, batch: int, timeout: float,
                 authkey: bytes):
        from multiprocessing.connection import Client

        host, port = address.rsplit(":", 1)
        self.timeout = timeout
        self.pipe = Client((host, int(port)), authkey=authkey)
        self.pipe.send((backend, slot_bytes, batch))
        self._reply = _Spawned._reply.__get__(self)  # same framing and errors as a spawned peer
        self._reply("start")

    call = _Spawned.call

    def close(self) -> None:
        try:
            self.pipe.send(("stop", ()))
        except (OSError, BrokenPipeError):
            pass
        self.pipe.close()


def listen(address: str, authkey: bytes, timeout: float | None = None) -> None:
    """Serve one remote bench session on ``host:port`` (the target side of ``--connect``)."""
    from multiprocessing.connection import Listener

    host, port = address.rsplit(":", 1)
    with Listener((host, int(port)), authkey=authkey) as listener:
        conn = listener.accept()
        if not conn.poll(timeout or 60):
            raise TransferTimeout("no session parameters from the initiator")
        backend, slot_bytes, batch = conn.recv()
        _serve(conn, backend, slot_bytes, batch)
