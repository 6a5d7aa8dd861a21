"""A target process for the transport tests (imported by spawned children).

It registers a zeroed pool (``shared``: inside :func:`kvxfer.shared_empty` memory), sends ``(metadata, region_id)`` through its pipe,
then serves commands while driving progress: ``bytes`` (the pool's contents),
``deregister`` (returns fresh metadata),
``guards`` (the ``guard_bytes`` on each side of the pool, unregistered, filled
with 0xA5), ``rejected`` (transfers it refused as a target), ``exit``.
"""
import os
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
