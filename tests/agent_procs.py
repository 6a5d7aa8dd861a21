"""Child-process bodies for the multi-process agent tests (spawned, so importable).

Every pool is filled from a seed, so the parent can rebuild the expected bytes
without shipping tensors between processes.
"""
from __future__ import annotations

import contextlib
import os
import time

SECRET = b"test-secret-0123456789"
SHAPE = dict(L=4, N=32, B=4, H=4, D=16)


def make_pool(dims: str, seed: int | None, *, dtype="float16", tp_rank=0, tp_size=1, shape=None):
    """A pool named by ``dims`` (per-layer tensors, or one tensor if ``dims`` has ``L``;
    ``N B C`` is an MLA latent pool); random values from ``seed``, zeros if it is None."""
    import torch

    from kvxfer import KVLayout

    s = dict(SHAPE, **(shape or {}))
    sizes = {"N": s["N"], "2": 2, "B": s["B"], "H": s["H"] // tp_size, "D": s["D"], "C": s["D"],
             "L": s["L"]}
    letters = dims.split()
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed or 0)
    tensors = []
    for _ in range(1 if "L" in letters else s["L"]):
        shape_t = [sizes[c] for c in letters]
        if seed is None:
            tensors.append(torch.zeros(shape_t, dtype=dt))
        else:
            tensors.append((torch.randn(shape_t, generator=g) * 10).to(dt))
    if "L" in letters:
        tensors = tensors[0]
    return KVLayout.from_tensors(tensors, dims, tp_rank=tp_rank, tp_size=tp_size)


@contextlib.contextmanager
def loopback_pair(config=None, dims: str = "2 N B H D"):
    """Two in-process agents over the loopback backend, zero-copy path: P's pool seeded,
    D's zeroed, P connected to D. Yields ``(p, d, peer, src, dst)``; closes both."""
    from kvxfer import Agent, AgentConfig

    config = (config or AgentConfig()).replace(path="zero_copy")
    p = Agent("p", secret=SECRET, backend="loopback", config=config)
    d = Agent("d", secret=SECRET, backend="loopback", config=config)
    try:
        src, dst = make_pool(dims, 1), make_pool(dims, None)
        p.register_kv(src)
        d.register_kv(dst)
        yield p, d, p.connect(d.address), src, dst
    finally:
        p.close()
        d.close()


def prefill(address, request_ids, block_ids, out_q, *, dims="2 N B H D", seed=1, tp_rank=0, tp_size=1,
            backend="auto", path="auto", dtype="float16", stream_then_hang=False, shape=None,
            staging_bytes=32 << 20):
    """P: connect to D, send each request (from ``block_ids``, or from ``block_ids[request]``
    if it is a dict), report ("ok", stats) or ("err", repr)."""
    from kvxfer import Agent, AgentConfig

    try:
        layout = make_pool(dims, seed, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, shape=shape)
        with Agent(f"p{tp_rank}", secret=SECRET, backend=backend,
                   config=AgentConfig(path=path, staging_bytes=staging_bytes)) as agent:
            agent.register_kv(layout)
            peer = agent.connect(address)
            if stream_then_hang:
                h = agent.send_layer(peer, request_ids[0], 0, block_ids)
                h.wait(30.0, layer=0)
                out_q.put(("streamed", os.getpid()))
                time.sleep(600)
            handles = [agent.send(peer, r, block_ids[r] if isinstance(block_ids, dict) else block_ids)
                       for r in request_ids]
            for h in handles:
                h.wait(30.0)
            out_q.put(("ok", {"transport": peer.transport, "paths": sorted({h.path for h in handles})}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        out_q.put(("err", repr(exc)))
