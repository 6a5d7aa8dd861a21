"""One engine's side of tests/test_store_netns.py, run inside a namespace "host".

``python store_netns_engine.py URL NODES OP SEED [ALL LIVE]``: opens ``kvxfer.KVStore(discovery=URL)``
(secret from ``KVXFER_SECRET``), waits until it sees ``NODES`` live store nodes, then

- ``put``: fills a pool from ``SEED`` (store_cases.make_layout) and puts its 16 blocks;
- ``get``: gets the 16 blocks into an empty pool of another layout;
- ``get-on ALL LIVE``: gets only the blocks whose keys rendezvous hashing over the
  comma-separated ``ALL`` node addresses places on ``LIVE``;

and prints one JSON line: ``lookup`` (leading keys present after the op), ``loaded``
(blocks a get loaded), ``blocks`` (the source block of each position got), ``error`` (the typed error's class, or null), ``sha`` (sha256 of
each loaded block's bits) and ``nodes``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import kvxfer
from store_cases import block_bits, make_layout

BLOCKS = 16


def chain() -> list:
    return kvxfer.block_keys(range(4 * BLOCKS), 4, salt=b"netns")


def main(url: str, nodes: int, op: str, seed: int, placed=None) -> None:
    secret = os.environ["KVXFER_SECRET"].encode()
    keys = chain()
    blocks = list(range(BLOCKS))
    if op == "get-on":
        from kvxfer.store.placement import owners

        every, live = placed[0].split(","), placed[1]
        blocks = [i for i in blocks if owners(every, keys[i])[0] == live]
    with kvxfer.KVStore(discovery=url, secret=secret, timeout=5.0, retry_s=60.0) as st:
        deadline = time.monotonic() + 60
        while sum(1 for s in st.nodes().values() if s == "up") < nodes:
            if time.monotonic() > deadline:
                raise SystemExit(f"saw {st.nodes()} store nodes, wanted {nodes}")
            time.sleep(0.2)
        out = {"error": None, "loaded": 0, "sha": [], "blocks": blocks}
        if op == "put":
            src = make_layout("2 N B H D", BLOCKS, seed=seed, head_dim=128)
            st.put(keys, src, range(BLOCKS)).wait(timeout=60)
        else:
            dst = make_layout("N 2 H B D", BLOCKS, head_dim=128)
            t0 = time.monotonic()
            try:
                st.get([keys[i] for i in blocks], dst, range(len(blocks))).wait(timeout=60)
                out["loaded"] = len(blocks)
            except (kvxfer.StoreMiss, kvxfer.PeerDisconnected, kvxfer.TransferTimeout) as exc:
                out["error"], out["loaded"] = type(exc).__name__, exc.loaded
            out["get_s"] = time.monotonic() - t0
            out["sha"] = [hashlib.sha256(block_bits(dst, i).numpy().tobytes()).hexdigest()
                          for i in range(out["loaded"])]
        out["lookup"] = st.lookup(keys)
        out["nodes"] = st.nodes()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:])
