"""vLLM CPU pools as kvxfer layouts: bytes named per (block, head, kv) cell, the CPU
attention kernel path in the fingerprint, and agents refusing to pair different paths."""
from __future__ import annotations

import types

import pytest
import torch

import kvxfer
from kvxfer import Agent, KVLayout
from kvxfer.errors import LayoutMismatch

from agent_procs import SECRET


def cpu_pool(num_layers=3, num_blocks=8, heads=2, block=32, head_dim=16, seed=None, dtype=torch.float32):
    """vLLM CPU style: one storage, per layer ``[N, H, B, 2*D]`` views."""
    store = torch.zeros(num_layers, num_blocks, heads, block, 2 * head_dim, dtype=dtype)
    if seed is not None:
        store.copy_(torch.randn(store.shape, generator=torch.Generator().manual_seed(seed)))
    return {f"model.layers.{i}.self_attn.attn": store[i] for i in range(num_layers)}


def as_layout(caches, fmt):
    views = [t.view(t.shape[0], t.shape[1], 2, t.shape[2], t.shape[3] // 2) for t in caches.values()]
    return KVLayout.from_tensors(views, "N H 2 B D", byte_format=fmt)


def test_byte_format_in_fingerprint():
    a, b = as_layout(cpu_pool(), "vllm-cpu:vec"), as_layout(cpu_pool(), "vllm-cpu:amx")
    assert a.fingerprint().endswith(";format=vllm-cpu:vec")
    assert not a.compatible_with(b) and a.compatible_with(as_layout(cpu_pool(), "vllm-cpu:vec"))
    plain = KVLayout.from_tensors([t.view(8, 2, 2, 32, 16) for t in cpu_pool().values()], "N H 2 B D")
    assert "format" not in plain.fingerprint() and not plain.compatible_with(a)
    with pytest.raises(ValueError):
        as_layout(cpu_pool(), "bad;format")


def test_agents_with_different_kernel_paths_do_not_pair():
    p = Agent("p", secret=SECRET, backend="loopback")
    d = Agent("d", secret=SECRET, backend="loopback")
    try:
        p.register_kv(as_layout(cpu_pool(), "vllm-cpu:vec"))
        d.register_kv(as_layout(cpu_pool(), "vllm-cpu:vec16"))
        with pytest.raises(LayoutMismatch):
            d.connect(p.address)
    finally:
        p.close()
        d.close()


def test_same_path_moves_whole_cells_bitwise():
    src, dst = cpu_pool(seed=1), cpu_pool()
    p = Agent("p", secret=SECRET, backend="loopback")
    d = Agent("d", secret=SECRET, backend="loopback")
    try:
        p.register_kv(as_layout(src, "vllm-cpu:vec"))
        d.register_kv(as_layout(dst, "vllm-cpu:vec"))
        d.connect(p.address)
        hr = d.recv("r", [5, 6], skip_blocks=1, timeout=20)
        p.send(None, "r", [1, 2, 3]).wait(20)
        hr.wait(20)
        for name in src:
            assert torch.equal(dst[name][[5, 6]], src[name][[2, 3]])
            assert not dst[name][[0, 1, 2, 3, 4, 7]].any()
    finally:
        p.close()
        d.close()


def test_cpu_layout_reads_the_kernel_path():
    pytest.importorskip("vllm")
    from kvxfer.integrations.vllm.layout import attention_path, cpu_layout

    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32),
                                cache_config=types.SimpleNamespace(cache_dtype="auto"))
    layout = cpu_layout(cpu_pool(), cfg)
    assert layout.fingerprint().endswith(f";format=vllm-cpu:{attention_path(cfg, 32, 16)}")
    assert (layout.num_layers, layout.num_blocks, layout.num_heads, layout.block_size) == (3, 8, 2, 32)
    with pytest.raises(ValueError):
        cpu_layout({"x": torch.zeros(4, 2, 32, 33)}, cfg)
