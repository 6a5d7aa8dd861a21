"""A target process for the transport tests (imported by spawned children).

It registers a zeroed pool (``shared``: inside :func:`kvxfer.shared_empty` memory), sends ``(metadata, region_id)`` through its pipe,
then serves commands while driving progress: ``bytes`` (the pool's contents),
``deregister`` (returns fresh metadata),
``guards`` (the ``guard_bytes`` on each side of the pool, unregistered, filled
with 0xA5), ``rejected`` (transfers it refused as a target), ``exit``.
"""
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time


def serve(pipe, pool_bytes: int, env: dict, deadline_s: float = 120.0, guard_bytes: int = 0,
          shared: bool = False) -> None:
    os.environ.update(env)
    import numpy as np

    from kvxfer.transport import make_backend

    backend = make_backend("auto")
    if shared:  # kvxfer.shared_empty: a vm peer maps it and copies with memcpy
        from kvxfer import shared_empty

        whole = shared_empty(pool_bytes + 2 * guard_bytes).numpy()
        whole[:] = 0xA5
    else:
        whole = np.full(pool_bytes + 2 * guard_bytes, 0xA5, np.uint8)
    pool = whole[guard_bytes : guard_bytes + pool_bytes]
    pool[:] = 0
    rid = backend.register(pool.ctypes.data, pool.nbytes)
    pipe.send((backend.metadata(), rid))
    end = time.monotonic() + deadline_s  # never outlive a lost parent
    while time.monotonic() < end:
        backend.progress()
        if not pipe.poll(0.0005):
            continue
        cmd = pipe.recv()
        if cmd == "bytes":
            pipe.send(pool.tobytes())
        elif cmd == "guards":
            pipe.send(whole[:guard_bytes].tobytes() + whole[guard_bytes + pool_bytes :].tobytes())
        elif cmd == "rejected":
            pipe.send(backend.num_rejected)
        elif cmd == "deregister":
            backend.deregister(rid)
            pipe.send(backend.metadata())
        elif cmd == "exit":
            break
    backend.close()


@contextlib.contextmanager
def spawned(pool_bytes: int, env: dict, **kwargs):
    """A :func:`serve` child (spawned): yields ``(proc, pipe, metadata, region_id)`` and
    asks it to exit (then kills it) on the way out."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(theirs, pool_bytes, env), kwargs=kwargs, daemon=True)
    proc.start()
    try:
        if not ours.poll(60):
            raise TimeoutError("peer did not start")
        meta, rid = ours.recv()
        yield proc, ours, meta, rid
    finally:
        with contextlib.suppress(Exception):
            ours.send("exit")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def ask(pipe, cmd, timeout: float = 30):
    """Send a command to a :func:`serve` child and return its answer."""
    pipe.send(cmd)
    assert pipe.poll(timeout), f"peer did not answer {cmd!r}"
    return pipe.recv()


def write_until_killed(backend, conn, rows, proc, *, after_s: float, timeout: float = 20.0) -> float:
    """Write ``rows`` again and again while ``proc`` is SIGKILLed after ``after_s``; the
    write that meets the dead peer must raise PeerDisconnected (AssertionError if none
    did within 60 s). Returns the seconds that failing write took."""
    from kvxfer.errors import PeerDisconnected

    killer = threading.Timer(after_s, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            began = time.monotonic()
            try:
                backend.wait(backend.post(conn, "write", rows), timeout=timeout)
            except PeerDisconnected:
                return time.monotonic() - began
        raise AssertionError("no write failed with PeerDisconnected after the peer was killed")
    finally:
        killer.cancel()
