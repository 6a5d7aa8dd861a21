"""Two processes, one request: prefill (P) pushes its KV blocks to decode (D).

    python examples/two_process.py

D owns an HND pool, P an NHD (vLLM classic) pool; kvxfer converts on the way.
D posts ``recv`` first and P ships layer by layer as if it were still computing;
D waits for every layer, then checks the bytes. Runs in a few seconds on a laptop.
"""
from __future__ import annotations

import multiprocessing as mp
import os

import torch

import kvxfer

SECRET = os.environ.get("KVXFER_SECRET", "example-secret-not-for-production")
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 64, 16, 8, 64


def pool(dims: str, seed: int | None) -> kvxfer.KVLayout:
    sizes = {"2": 2, "N": BLOCKS, "B": BLOCK_SIZE, "H": HEADS, "D": HEAD_DIM}
    shape = [sizes[c] for c in dims.split()]
    g = torch.Generator().manual_seed(seed or 0)
    layers = [torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16) if seed is not None
              else torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return kvxfer.KVLayout.from_tensors(layers, dims)


def prefill(decode_address: str, block_ids: list) -> None:
    with kvxfer.Agent("prefill-0", secret=SECRET) as agent:
        agent.register_kv(pool("2 N B H D", seed=7))       # once, at startup
        peer = agent.connect(decode_address)               # authenticated, layouts checked
        for layer in range(LAYERS):                        # ship layer l while computing l+1
            handle = agent.send_layer(peer, "req-42", layer, block_ids)
        handle.wait(timeout=30.0)                          # visible in D's blocks
        print(f"prefill: sent {handle.nbytes} B via {peer.transport}, path={handle.path}")


def main() -> None:
    src_ids, dst_ids = [5, 17, 3, 40], [0, 9, 33, 2]
    layout = pool("N 2 H B D", seed=None)  # HND on the decode side
    with kvxfer.Agent("decode-0", secret=SECRET) as agent:
        agent.register_kv(layout)
        handle = agent.recv("req-42", dst_ids, timeout=60.0)   # before P even exists
        proc = mp.get_context("spawn").Process(target=prefill, args=(agent.address, src_ids))
        proc.start()
        try:
            handle.wait(timeout=60.0, layer=0)
            print("decode: layer 0 landed; could start attention on it")
            handle.wait(timeout=60.0)
        finally:
            proc.join(60.0)
            if proc.is_alive():
                proc.kill()
        expect = kvxfer.pack(pool("2 N B H D", seed=7), src_ids)
        assert torch.equal(expect, kvxfer.pack(layout, dst_ids)), "bytes differ"
        print(f"decode: {handle!r} bitwise equal")
        print(agent.metrics.prometheus().splitlines()[0])


if __name__ == "__main__":
    main()
