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

Endpoints run in two spawned processes (:class:`SpawnedEndpoint`), in this
process for backends that cannot cross processes (:class:`LocalEndpoint`,
``loopback``), or on another host (:class:`RemoteEndpoint`, ``--listen``).
``--check`` fills the source from a seed and the destination with other bytes
before every iteration, and the destination re-derives and compares every byte.
"""
from __future__ import annotations

import time

from ..errors import KVXferError, PeerDisconnected, TransferTimeout

IN_PROCESS_BACKENDS = ("loopback",)


def _pattern(seed: int, nbytes: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Endpoint:
    """One side: backend, registered pool + staging, and the commands the session sends."""

    def __init__(self, backend: str, slot_bytes: int, batch: int):
        from .. import AgentConfig
        from ..transport import make_backend
        from .copy_limit import page_aligned

        # an entry point: KVXFER_* overrides apply (KVXFER_TCP_LANES in benchmarks/tcp_netns.sh)
        self.backend = make_backend(backend, **({} if backend == "loopback" else {"config": AgentConfig.from_env()}))
        self.pool = page_aligned(2 * batch * slot_bytes)
        self.staging = page_aligned(batch * slot_bytes)
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
    try:
        while True:
            _serve_until_command(ep.backend, conn)
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


def _serve_until_command(backend, conn) -> None:
    """Drive the backend as a target until the pipe has a command.

    A target must progress for the transports whose writes and reads it serves
    itself (UCX ``+am-rma``: kvxfer's target-checked messages over TCP). It sleeps
    in ``select`` on the UCX worker's event fd and the pipe, as the Agent's I/O
    thread does, so it neither spins (on a small shared machine a spinning target
    takes the core the initiator needs) nor answers late (a fixed nap between
    progress calls delayed every message by up to the nap).
    """
    import select

    fd = backend.event_fd()
    if fd is None:  # vm, loopback: one-sided, nothing to serve
        return
    while not conn.poll():
        if backend.arm():  # idle and armed: sleep until UCX or the pipe has something
            select.select([conn, fd], [], [], 1.0)


class SpawnedEndpoint:
    """An :class:`Endpoint` in a spawned process, driven through a pipe."""

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


class LocalEndpoint:
    """An :class:`Endpoint` in this process (in-process backends)."""

    def __init__(self, backend: str, slot_bytes: int, batch: int):
        self.ep = Endpoint(backend, slot_bytes, batch)

    def call(self, cmd: str, *args):
        return getattr(self.ep, cmd)(*args)

    def close(self) -> None:
        self.ep.close()


class RemoteEndpoint:
    """An endpoint on another host, started by ``kvxfer bench transfer --listen``."""

    def __init__(self, address: str, backend: str, slot_bytes: int, batch: int, timeout: float,
                 authkey: bytes):
        from multiprocessing.connection import Client

        host, port = address.rsplit(":", 1)
        self.timeout = timeout
        self.pipe = Client((host, int(port)), authkey=authkey)
        self.pipe.send((backend, slot_bytes, batch))
        self._reply = SpawnedEndpoint._reply.__get__(self)  # same framing and errors as a spawned peer
        self._reply("start")

    call = SpawnedEndpoint.call

    def close(self) -> None:
        try:
            self.pipe.send(("stop", ()))
        except (OSError, BrokenPipeError):
            pass
        self.pipe.close()


def accept_session(address: str, authkey: bytes, timeout: float | None = None):
    """Accept one authenticated connection on ``host:port``; return it and its first
    message (the session parameters), waiting at most ``timeout`` (60 s) for them."""
    from multiprocessing.connection import Listener

    host, port = address.rsplit(":", 1)
    with Listener((host, int(port)), authkey=authkey) as listener:
        conn = listener.accept()
    if not conn.poll(timeout or 60):
        conn.close()
        raise TransferTimeout("no session parameters from the initiator")
    return conn, conn.recv()


def listen(address: str, authkey: bytes, timeout: float | None = None) -> None:
    """Serve one remote bench session on ``host:port`` (the target side of ``--connect``)."""
    conn, (backend, slot_bytes, batch) = accept_session(address, authkey, timeout)
    _serve(conn, backend, slot_bytes, batch)
