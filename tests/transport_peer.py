"""A target process for the transport tests (imported by spawned children).

It registers a zeroed pool, sends ``(metadata, region_id)`` through its pipe,
then serves commands while driving progress: ``bytes`` (the pool's contents),
``notes`` (notifications received), ``deregister`` (returns fresh metadata),
``exit``.
"""
import os
import time


def serve(pipe, pool_bytes: int, env: dict, deadline_s: float = 120.0) -> None:
    os.environ.update(env)
    import numpy as np

    from kvxfer.transport import make_backend

    backend = make_backend("auto")
    pool = np.zeros(pool_bytes, np.uint8)
    rid = backend.register(pool.ctypes.data, pool.nbytes)
    pipe.send((backend.metadata(), rid))
    notes = []
    end = time.monotonic() + deadline_s  # never outlive a lost parent
    while time.monotonic() < end:
        backend.progress()
        notes += backend.poll_notifications()
        if not pipe.poll(0.0005):
            continue
        cmd = pipe.recv()
        if cmd == "bytes":
            pipe.send(pool.tobytes())
        elif cmd == "notes":
            pipe.send(notes)
        elif cmd == "deregister":
            backend.deregister(rid)
            pipe.send(backend.metadata())
        elif cmd == "exit":
            break
    backend.close()
