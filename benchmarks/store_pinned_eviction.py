"""A store node's eviction with many pinned objects: one 4,096-key RESERVE on a full node
(16,384 objects of 64 B, in-process, over its socket) whose 12,000 oldest objects a reader
pins, against the same reserve with none pinned (the yardstick, same run). Each timed
reserve is checked: every key reserved.

    .venv/bin/python benchmarks/store_pinned_eviction.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import kvxfer  # noqa: E402
from kvxfer.store import index as ix  # noqa: E402
from kvxfer.store.conn import NodeConn  # noqa: E402
from kvxfer.store.node import StoreNode  # noqa: E402
from kvxfer.store.protocol import Req, format_tag  # noqa: E402

SECRET = b"store-pinned-eviction-benchmark-secret"
SIZE = 64
FMT = format_tag("bench", SIZE)


def one(num_pinned: int, num_objects: int = 16384, num_new: int = 4096) -> float:
    """Seconds of one RESERVE of ``num_new`` keys on a full node whose ``num_pinned`` oldest
    objects are pinned."""
    node = StoreNode("127.0.0.1:0", num_objects * SIZE, secret=SECRET, slot_bytes=SIZE, lease_s=600)
    backend = kvxfer.transport.make_backend("auto")
    c = NodeConn.open(node.address, SECRET, backend, 60)
    try:
        keys = [b"old%d" % i for i in range(num_objects)]

        def put(part):
            r = c.request(Req.RESERVE, {"keys": part, "nbytes": SIZE, "fmt": FMT}, 60)["r"]
            ok = c.request(Req.COMMIT, {"keys": part, "tokens": [t for _, _, t in r], "crcs": [1] * len(part)}, 60)
            assert all(ok["ok"]), "the fill did not commit"

        for s in range(0, num_pinned, 4096):  # the oldest objects, pinned by a reader
            part = keys[s:min(num_pinned, s + 4096)]
            put(part)
            assert all(x[3] > 0 for x in c.request(Req.GET, {"keys": part, "fmt": FMT}, 60)["r"])
        for s in range(num_pinned, num_objects, 4096):
            put(keys[s:min(num_objects, s + 4096)])
        new = [b"new%d" % i for i in range(num_new)]
        t0 = time.perf_counter()
        r = c.request(Req.RESERVE, {"keys": new, "nbytes": SIZE, "fmt": FMT}, 120)["r"]
        dt = time.perf_counter() - t0
        assert all(code == ix.RESERVED for code, _, _ in r), "a key of the timed reserve was not reserved"
        return dt
    finally:
        c.close()
        backend.close()
        node.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pinned", type=int, default=12000)
    args = ap.parse_args()
    base = min(one(0) for _ in range(args.repeat))
    pinned = min(one(args.pinned) for _ in range(args.repeat))
    print(f"4,096-key reserve on a full node of 16,384 objects (best of {args.repeat}): none pinned "
          f"{base * 1e3:.1f} ms, {args.pinned:,} pinned {pinned * 1e3:.1f} ms, ratio {pinned / base:.2f}")


if __name__ == "__main__":
    main()
