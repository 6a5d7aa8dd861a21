"""Shared helpers of the store tests: pools in several layouts, node processes."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

import torch

import kvxfer

SECRET = b"store-test-secret-0123456789abcdef"
L, B, H, D = 3, 4, 4, 8  # layers, tokens per block, kv heads of the model, head dim
DTYPE = torch.float16

# dims -> the per-layer tensor shape for num_blocks n and h heads
SHAPES = {
    "2 N B H D": lambda n, h, d: (2, n, B, h, d),
    "N 2 H B D": lambda n, h, d: (n, 2, h, B, d),
    "N 2 B H D": lambda n, h, d: (n, 2, B, h, d),
}


def make_layout(dims: str, num_blocks: int, *, tp_rank: int = 0, tp_size: int = 1, seed: int | None = None,
                head_dim: int = D):
    """A host pool of ``L`` per-layer tensors in ``dims``, holding this rank's ``H // tp_size``
    heads; random bits (NaN patterns included) if ``seed`` is given, else zeros. With
    ``head_dim=128`` an NHD block's (layer, K/V) tile is 4 KiB: the store's zero-copy path."""
    h = H // tp_size
    shape = SHAPES[dims](num_blocks, h, head_dim)
    if seed is None:
        tensors = [torch.zeros(shape, dtype=DTYPE) for _ in range(L)]
    else:
        g = torch.Generator().manual_seed(seed)
        tensors = [torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=g).view(DTYPE)
                   for _ in range(L)]
    return kvxfer.KVLayout.from_tensors(tensors, dims, tp_rank=tp_rank, tp_size=tp_size)


def block_bits(layout, block: int) -> torch.Tensor:
    """``[L, 2, B, heads of this rank, D]`` int16 bits of one block (the oracle: the layout's views)."""
    return torch.stack([torch.stack([layout.kv_view(l, kv)[block] for kv in range(2)])
                        for l in range(layout.num_layers)]).view(torch.int16).clone()


def fill_block(layout, block: int, value: int) -> None:
    """Every element of ``block`` := a value derived from ``value`` (distinct per block)."""
    for l in range(layout.num_layers):
        for kv in range(2):
            view = layout.kv_view(l, kv)[block]
            bits = torch.arange(view.numel(), dtype=torch.int32).view(view.shape) * 7 + value * 1000 + l * 10 + kv
            view.view(torch.int16).copy_((bits % 30000).to(torch.int16))


def start_node(*, port: int = 0, capacity: str = "16M", slot: str = "64K", extra=(), secret=SECRET,
               timeout: float = 120.0, wrap=None, stderr=subprocess.DEVNULL):
    """``kvxfer store`` in its own process; returns ``(proc, "host:port")``. ``wrap``: a
    function of the command (argv) that returns the one to run instead (e.g. in a mount
    namespace); ``stderr``: where its log goes."""
    env = {**os.environ, "KVXFER_SECRET": secret.decode()}
    cmd = [sys.executable, "-m", "kvxfer.cli", "store", "--listen", f"127.0.0.1:{port}", "--capacity", capacity,
           "--slot-size", slot, "--log-level", "warning", *extra]
    proc = subprocess.Popen(wrap(cmd) if wrap else cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(1.0):
            line = proc.stdout.readline()
            if line.startswith("kvxfer store listening on "):
                sel.close()
                return proc, line.rsplit(" ", 1)[1].strip()
            if not line and proc.poll() is not None:
                break
    stop_node(proc)
    raise AssertionError("kvxfer store did not start")


def stop_node(proc, sig=signal.SIGTERM) -> int:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=30)
