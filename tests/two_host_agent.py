"""One side of the two-hosts test, run inside a namespace "host" (see tests/netns.py).

``python two_host_agent.py d LISTEN DIR``: register a zeroed pool, post the
recv, write ``DIR/d.ready``; once the KV landed save the pool to ``DIR/d.pt``.
``python two_host_agent.py p LISTEN DIR D_ADDRESS``: register a seeded pool,
connect to D, send, write ``DIR/p.json`` (the transport used).
Both then stay up (agents listening) until ``DIR/quit`` exists, so the test can
list their sockets; every wait is bounded.
"""
from __future__ import annotations

import json
import os
import sys
import time

SECRET = b"two-hosts-test-secret-0123456789"
SHAPE = (32, 4, 2, 16, 4, 16)  # N L 2 B H D, fp16
SRC_BLOCKS = [3, 7, 8, 20, 31]
DST_BLOCKS = [1, 2, 30, 5, 0]
WAIT_S = 120.0


def make_pool(seeded: bool):
    import torch

    if not seeded:
        return torch.zeros(SHAPE, dtype=torch.float16)
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(SHAPE, generator=g) * 10).to(torch.float16)


def _wait_file(path: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S:.0f}s")
        time.sleep(0.05)


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def main(role: str, listen: str, out: str, d_address: str | None = None) -> int:
    import torch

    import kvxfer

    pool = make_pool(seeded=role == "p")
    with kvxfer.Agent(role, listen=listen, secret=SECRET, backend="ucx") as agent:
        agent.register_kv(kvxfer.KVLayout.from_tensors(pool, "N L 2 B H D"))
        if role == "d":
            handle = agent.recv("req-1", DST_BLOCKS, timeout=WAIT_S)
            _write(os.path.join(out, "d.ready"), agent.address.encode())
            handle.wait(WAIT_S)
            torch.save(pool, os.path.join(out, "d.pt.tmp"))
            os.replace(os.path.join(out, "d.pt.tmp"), os.path.join(out, "d.pt"))
        else:
            peer = agent.connect(d_address)
            agent.send(peer, "req-1", SRC_BLOCKS).wait(WAIT_S)
            _write(os.path.join(out, "p.json"), json.dumps({"transport": peer.transport,
                                                              "hostname": os.uname().nodename,
                                                              "pid": os.getpid()}).encode())
        _wait_file(os.path.join(out, "quit"))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
