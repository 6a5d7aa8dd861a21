"""Write sweep between two spawned processes, with same-run limits.

``measure_write_sweep`` starts a *target* (registers a pool, serves progress)
and an *initiator* (registers a source buffer, connects, posts writes) per
mode, as fresh spawned processes so each mode gets its own UCX environment:

* ``vm``  - the same-host process_vm_writev path;
* ``ucx`` - UCX forced, its default same-host transports (peer error handling);
* ``tcp`` - UCX with ``UCX_TLS=tcp`` in both processes.

Each run size writes ``total_bytes`` as ``total_bytes / run`` descriptors from a
contiguous source to randomly permuted pool slots (blocks scattered as in a real
KV pool, so nothing coalesces). The limits, measured in the same run:
``memcpy`` - one thread copying the same descriptors inside the initiator;
``socket`` - a plain Python TCP socket over loopback moving ``total_bytes``.
Figures are the median of ``iters`` timed repetitions after one warm-up.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time

DEFAULT_RUNS = (4096, 8192, 32768, 262144, 1 << 20)
MODES = ("vm", "ucx", "tcp")
_TIMEOUT = 120.0


def _env(mode: str) -> dict:
    return {"UCX_TLS": "tcp"} if mode == "tcp" else {}


def _rows(np, src_rid, dst_rid, total, run, seed):
    n = total // run
    slots = np.random.default_rng(seed).permutation(n).astype(np.int64)
    i = np.arange(n, dtype=np.int64)
    return np.stack([np.full(n, src_rid), i * run, np.full(n, dst_rid), slots * run, np.full(n, run)], axis=1)


def _target(pipe, pool_bytes: int, env: dict) -> None:
    os.environ.update(env)
    import numpy as np

    from ..transport import make_backend

    backend = make_backend("auto")
    pool = np.zeros(pool_bytes, np.uint8)
    rid = backend.register(pool.ctypes.data, pool.nbytes)
    pipe.send((backend.metadata(), rid))
    end = time.monotonic() + 30 * _TIMEOUT
    while time.monotonic() < end and not pipe.poll(0):
        if backend.progress() == 0:
            time.sleep(0)  # yield: two busy processes on two cores
    backend.close()


def _timed(fn, iters: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _initiator(pipe, meta, dst_rid, mode, total, runs, iters) -> None:
    os.environ.update(_env(mode))
    import numpy as np

    from ..errors import InvalidDescriptor
    from ..transport import make_backend

    backend = make_backend("vm" if mode == "vm" else "ucx")
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    scratch = np.zeros(total, np.uint8)
    src_rid = backend.register(src.ctypes.data, src.nbytes)
    scratch_rid = backend.register(scratch.ctypes.data, scratch.nbytes)
    conn = backend.connect(meta)
    results = []
    for run in runs:
        rows = _rows(np, src_rid, dst_rid, total, run, seed=run)
        local = rows.copy()
        local[:, 2] = scratch_rid
        xfer = _timed(lambda: backend.wait(backend.post(conn, "write", rows), _TIMEOUT), iters)
        copy = _timed(lambda: backend._engine.local_copy(local), iters)
        t, c = statistics.median(xfer), statistics.median(copy)
        results.append({"mode": mode, "transport": conn.transport, "run_bytes": run, "num_descs": len(rows),
                        "bytes": total, "gbps": total / t / 1e9, "p50_ms": t * 1e3,
                        "memcpy_gbps": total / c / 1e9, "ratio_memcpy": c / t})
    # validation cost: 100k rows, the last one invalid, so nothing is posted
    n = 100_000
    rows = _rows(np, src_rid, dst_rid, n * 64, 64, seed=1)
    rows[-1, 4] = 0

    def _reject():
        try:
            backend.post(conn, "write", rows)
        except InvalidDescriptor:
            return
        raise AssertionError("invalid batch was accepted")

    validate_ms = statistics.median(_timed(_reject, iters)) * 1e3
    for r in results:
        r["validate_100k_ms"] = validate_ms
    backend.close()
    pipe.send(results)


def _socket_receiver(port_pipe, total: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_pipe.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while True:
        got = 0
        while got < total:
            n = conn.recv_into(view)
            if n == 0:
                return
            got += n
        conn.sendall(b"k")


def socket_loopback_gbps(total: int, iters: int) -> float:
    """Plain Python socket throughput over 127.0.0.1 (the limit for UCX over TCP)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_socket_receiver, args=(theirs, total), daemon=True)
    proc.start()
    try:
        if not ours.poll(_TIMEOUT):
            raise TimeoutError("socket receiver did not start")
        sock = socket.create_connection(("127.0.0.1", ours.recv()), timeout=_TIMEOUT)
        payload = memoryview(os.urandom(min(total, 1 << 20)) * max(1, total // (1 << 20)))[:total]

        def once():
            sock.sendall(payload)
            if sock.recv(1) != b"k":
                raise ConnectionError("socket receiver went away")

        t = statistics.median(_timed(once, iters))
        sock.close()
        return total / t / 1e9
    finally:
        proc.kill()
        proc.join(10)


def measure_write_sweep(runs=DEFAULT_RUNS, total_bytes: int = 64 << 20, modes=MODES, iters: int = 5,
                        progress=None) -> list[dict]:
    """Run the sweep; return one dict per (mode, run size).

    Keys: mode, transport, run_bytes, num_descs, bytes, gbps, p50_ms,
    memcpy_gbps, ratio_memcpy, validate_100k_ms; ``tcp`` rows add socket_gbps
    and ratio_socket. ``progress(done, todo)`` is called after each mode.
    """
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {MODES}")
    runs = [int(r) for r in runs]
    if any(r <= 0 or total_bytes % r for r in runs):
        raise ValueError("every run size must be > 0 and divide total_bytes")
    ctx = mp.get_context("spawn")
    rows: list[dict] = []
    for k, mode in enumerate(modes):
        t_ours, t_theirs = ctx.Pipe()
        i_ours, i_theirs = ctx.Pipe()
        target = ctx.Process(target=_target, args=(t_theirs, total_bytes, _env(mode)), daemon=True)
        target.start()
        init = None
        try:
            if not t_ours.poll(_TIMEOUT):
                raise TimeoutError("target did not start")
            meta, rid = t_ours.recv()
            init = ctx.Process(target=_initiator, args=(i_theirs, meta, rid, mode, total_bytes, runs, iters),
                               daemon=True)
            init.start()
            end = time.monotonic() + _TIMEOUT * len(runs)
            while not i_ours.poll(0.5):
                if not init.is_alive():
                    raise RuntimeError(f"{mode} initiator exited with code {init.exitcode}")
                if time.monotonic() > end:
                    raise TimeoutError(f"{mode} sweep did not finish")
            rows += i_ours.recv()
        finally:
            t_ours.send("exit")
            for p in (init, target):
                if p is not None:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
                        p.join(10)
        if progress:
            progress(k + 1, len(modes))
    if "tcp" in modes:
        limit = socket_loopback_gbps(total_bytes, iters)
        for r in rows:
            if r["mode"] == "tcp":
                r["socket_gbps"] = limit
                r["ratio_socket"] = r["gbps"] / limit
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'mode':5} {'transport':14} {'run':>8} {'descs':>7} {'GB/s':>7} {'memcpy':>7} {'x memcpy':>8} {'socket':>7} {'x sock':>6}"
    lines = [head]
    for r in rows:
        sock = f"{r['socket_gbps']:7.2f} {r['ratio_socket']:6.2f}" if "socket_gbps" in r else f"{'':7} {'':6}"
        lines.append(f"{r['mode']:5} {r['transport']:14} {r['run_bytes']:>8} {r['num_descs']:>7} {r['gbps']:7.2f} "
                     f"{r['memcpy_gbps']:7.2f} {r['ratio_memcpy']:8.2f} {sock}")
    if rows:
        lines.append(f"validate 100k descriptors: {rows[0]['validate_100k_ms']:.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(measure_write_sweep()))
