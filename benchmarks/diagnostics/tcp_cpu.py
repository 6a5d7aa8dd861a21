"""CPU seconds per GB of kvxfer writes over UCX TCP (loopback), initiator and target.

    PYTHONPATH=. python benchmarks/diagnostics/tcp_cpu.py [BLOCK_KIB:BATCH:ITERS ...]   # default 4:2048:20 64:64:40 1024:16:20

On a shared machine wall-clock GB/s swings with the load; the CPU both sides spend
per byte moved (user + system, ``getrusage`` around the timed loop only) moves much
less, so it is the figure to compare code or UCX settings with while others run.
Both sides sleep on the UCX worker's event fd when idle (no spinning, so waiting
costs nothing). ``iperf3`` on loopback gives the native socket's CPU per GB
(from its own ``cpu_utilization_percent``) for scale when installed.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import select
import shutil
import subprocess
import sys
import time

ENV = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sleep(backend, extra=()) -> None:
    if backend.arm():  # idle and armed: sleep until UCX (or the pipe) has something
        select.select([backend.event_fd(), *extra], [], [], 0.05)


def _target(pipe, nbytes: int) -> None:
    os.environ.update(ENV)
    import numpy as np

    from kvxfer.transport import make_backend

    b = make_backend("ucx")
    pool = np.zeros(nbytes, np.uint8)
    rid = b.register(pool.ctypes.data, pool.nbytes)
    pipe.send((b.metadata(), rid))
    c0 = 0.0
    try:
        while True:
            while not pipe.poll():
                _sleep(b, (pipe,))
            cmd = pipe.recv()
            if cmd == "start":
                c0 = _cpu()
                pipe.send(None)
            elif cmd == "stop":
                pipe.send(_cpu() - c0)
            else:
                return
    finally:
        b.close()


def measure(block: int, batch: int, iters: int, timeout: float = 60.0) -> dict:
    """One row: ``batch`` runs of ``block`` bytes per write, ``iters`` timed writes."""
    import numpy as np

    from kvxfer.transport import make_backend

    os.environ.update(ENV)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(theirs, 2 * block * batch), daemon=True)
    proc.start()
    b = make_backend("ucx")
    try:
        if not ours.poll(timeout):
            raise TimeoutError("target did not start")
        meta, rid = ours.recv()
        src = np.ones(2 * block * batch, np.uint8)
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        offs = np.arange(batch, dtype=np.int64) * 2 * block
        descs = np.stack([np.full(batch, ls), offs, np.full(batch, rid), offs, np.full(batch, block)], 1)

        def write():
            req, deadline = b.post(conn, "write", descs), time.monotonic() + timeout
            while not b.test(req):
                if time.monotonic() > deadline:
                    raise TimeoutError("write did not complete")
                _sleep(b)

        for _ in range(3):
            write()
        ours.send("start")
        ours.recv()
        c0, t0 = _cpu(), time.perf_counter()
        for _ in range(iters):
            write()
        wall, init = time.perf_counter() - t0, _cpu() - c0
        ours.send("stop")
        if not ours.poll(timeout):
            raise TimeoutError("target did not report")
        target = ours.recv()
        gb = block * batch * iters / 1e9
        return {"block": block, "batch": batch, "transport": conn.transport, "gbps": gb / wall,
                "initiator_s_per_gb": init / gb, "target_s_per_gb": target / gb,
                "total_s_per_gb": (init + target) / gb}
    finally:
        ours.send("exit")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        b.close()


def iperf3_row(seconds: int = 3, port: int = 5399) -> dict | None:
    if shutil.which("iperf3") is None:
        return None
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-l", "128K",
                              "-J"], capture_output=True, text=True, timeout=seconds + 30).stdout
    finally:
        server.wait(timeout=30)
    end = json.loads(out)["end"]
    gbps = end["sum_received"]["bits_per_second"] / 8e9
    cpu = end["cpu_utilization_percent"]
    return {"gbps": gbps, "total_s_per_gb": (cpu["host_total"] + cpu["remote_total"]) / 100 / gbps}


def main(argv: list[str]) -> int:
    specs = argv or ["4:2048:20", "64:64:40", "1024:16:20"]
    print(f"load: {open('/proc/loadavg').read().split()[:3]}")
    for spec in specs:
        kib, batch, iters = (int(x) for x in spec.split(":"))
        r = measure(kib * 1024, batch, iters)
        print(f"{kib:>5} KiB x {batch:<5} {r['transport']}: initiator {r['initiator_s_per_gb']:.2f} "
              f"+ target {r['target_s_per_gb']:.2f} = {r['total_s_per_gb']:.2f} CPU s/GB "
              f"({r['gbps']:.2f} GB/s wall)")
    ip = iperf3_row()
    if ip:
        print(f"iperf3 loopback: {ip['total_s_per_gb']:.2f} CPU s/GB ({ip['gbps']:.2f} GB/s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
