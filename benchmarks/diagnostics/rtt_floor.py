"""The floor under kvxfer's 1-block round trip on this machine, measured now.

Two processes on loopback TCP, 128-byte messages, no kvxfer code:

- ``pingpong``: the main threads block in ``recv`` on both sides (2 wake-ups per trip);
- ``threaded``: the agent's shape -- the requester's main thread sends and waits on a
  ``threading.Condition``, its I/O thread (``select``) receives and notifies; the
  responder answers from its I/O thread (3 wake-ups per trip, GIL hand-off included).

Run it right before/after ``kvxfer bench e2e --model smollm2-135m --rtt-iters 300`` and
compare the round trip with these (the machine is shared; the load average is printed)::

    python benchmarks/diagnostics/rtt_floor.py --iters 2000
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import selectors
import socket
import threading
import time

MSG = b"x" * 128


def _recv_exact(sock, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf


def _responder(port: int, threaded: bool) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not threaded:
        while True:
            try:
                sock.sendall(_recv_exact(sock, len(MSG)))
            except ConnectionError:
                return
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    pending = b""
    while True:
        sel.select(10.0)
        data = sock.recv(1 << 16)
        if not data:
            return
        pending += data
        while len(pending) >= len(MSG):
            sock.sendall(pending[:len(MSG)])
            pending = pending[len(MSG):]


def measure(iters: int, threaded: bool) -> list:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    proc = mp.get_context("spawn").Process(target=_responder, args=(lsock.getsockname()[1], threaded), daemon=True)
    proc.start()
    lsock.settimeout(60)
    sock, _ = lsock.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    try:
        if not threaded:
            for _ in range(iters):
                t0 = time.perf_counter()
                sock.sendall(MSG)
                _recv_exact(sock, len(MSG))
                times.append(time.perf_counter() - t0)
            return times
        cond, got = threading.Condition(), [0]

        def io() -> None:
            sel = selectors.DefaultSelector()
            sel.register(sock, selectors.EVENT_READ)
            pending = 0
            while True:
                sel.select(10.0)
                data = sock.recv(1 << 16)
                if not data:
                    return
                pending += len(data)
                with cond:
                    got[0] += pending // len(MSG)
                    pending %= len(MSG)
                    cond.notify_all()

        threading.Thread(target=io, daemon=True).start()
        for i in range(iters):
            t0 = time.perf_counter()
            sock.send(MSG)
            with cond:
                if not cond.wait_for(lambda: got[0] > i, 10.0):
                    raise TimeoutError("no answer in 10 s")
            times.append(time.perf_counter() - t0)
        return times
    finally:
        sock.close()
        lsock.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    for threaded in (False, True):
        ts = sorted(measure(args.iters, threaded)[args.iters // 10:])
        p50, p99 = ts[len(ts) // 2] * 1e6, ts[int(len(ts) * 0.99)] * 1e6
        print(f"  {'threaded' if threaded else 'pingpong'}: p50 {p50:.0f} us  p99 {p99:.0f} us")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the end")


if __name__ == "__main__":
    main()
