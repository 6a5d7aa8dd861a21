"""Stream ordering of the agent, on CPU: real transfers between two agents (loopback
backend, one process) whose pack/unpack run *later* on a deferred device
(tests/deferred_device.py), with the engine's writes deferred too and passed as
``after=``. Every wait the agent owes (producer before the zero-copy post, producer
before the pack, pack before the post, unpack before free/ACK/completion) is needed
for these bytes to arrive intact: drop one and a test here fails.
"""
from __future__ import annotations

import pytest
import torch

import kvxfer
from kvxfer import Agent, AgentConfig

from agent_procs import SECRET, make_pool
from deferred_device import DeferredDevice, DeferredEvent, DeferredStream
from host_ipc import HostIpc

T = 30.0
SRC, DST = [9, 3, 31, 0, 4, 17], [2, 30, 7, 11, 5, 20]


def _agents(path, *, p_delay=0.05, d_delay=0.05, staging=32 << 20):
    """``path="cuda_peer"``: both devices offer their pools (host stand-in for CUDA IPC)."""
    p_layout, d_layout = make_pool("2 N B H D", None), make_pool("2 N B H D", None)
    p_dev, d_dev = DeferredDevice(p_delay), DeferredDevice(d_delay)
    if path == "cuda_peer":
        for dev, layout in ((p_dev, p_layout), (d_dev, d_layout)):
            dev.ipc = HostIpc()
            dev.ipc.add_layout(layout)
    cfg = AgentConfig(path="auto" if path == "cuda_peer" else path, staging_bytes=staging)
    p = Agent("p", secret=SECRET, backend="loopback", config=cfg, device=p_dev)
    d = Agent("d", secret=SECRET, backend="loopback", config=cfg, device=d_dev)
    p.register_kv(p_layout)
    d.register_kv(d_layout)
    return p, d, p_layout, d_layout, p.connect(d.address), (p_dev, d_dev)


def _produce(engine: DeferredStream, layout, ids, layers=None) -> tuple:
    """The engine writes random KV into ``ids`` later; returns (its event, the bytes it writes)."""
    want = make_pool("2 N B H D", 5)
    sel = range(layout.num_layers) if layers is None else layers

    def write():
        for layer in sel:
            for kv in range(layout.num_kv):
                layout.kv_view(layer, kv)[ids] = want.kv_view(layer, kv)[ids]

    return engine.submit(write), want


def _same(want, src_ids, dst_layout, dst_ids, layers=None) -> bool:
    return torch.equal(kvxfer.pack(want, src_ids, layers=layers, backend="reference"),
                       kvxfer.pack(dst_layout, dst_ids, layers=layers, backend="reference"))


@pytest.mark.parametrize("path", ["zero_copy", "pack", "cuda_peer"])
def test_send_waits_for_the_producer_and_recv_for_the_scatter(path):
    """The engine's write lands 1 s after ``send(after=...)``; D checks its blocks the
    moment its recv completes. Fails if the zero-copy post does not host-wait for the
    producer, the pack (or the peer copy) is not queued behind it, the post (or DATA_DONE)
    does not wait for the pack (or the copy), or the recv completes before the unpack ran."""
    p, d, pl, dl, peer, devices = _agents(path)
    engine = DeferredStream(1.0, "engine")
    try:
        event, want = _produce(engine, pl, SRC)
        hr = d.recv("r", DST, timeout=T)
        hs = p.send(peer, "r", SRC, after=event)
        hr.wait(T)
        assert _same(want, SRC, dl, DST), "recv completed before the bytes were in place"
        hs.wait(T)
        assert hs.path == path and hr.path == ("zero_copy" if path == "cuda_peer" else path)
        assert event.query()
        if path == "pack":
            assert devices[0].launched >= 1 and devices[1].launched >= 1
        if path == "cuda_peer":
            assert devices[0].launched == 1 and devices[1].launched == 0
    finally:
        p.close()
        d.close()
        engine.close()
    assert not engine.errors and not devices[0].stream.errors and not devices[1].stream.errors


@pytest.mark.parametrize("path", ["zero_copy", "pack", "cuda_peer"])
def test_send_layer_waits_for_each_layers_event(path):
    """Layer by layer, each written by the engine later than the previous one."""
    p, d, pl, dl, peer, devices = _agents(path)
    engine = DeferredStream(0.1, "engine")
    try:
        hr = d.recv("s", DST, timeout=T)
        wants = []
        for layer in range(pl.num_layers):
            event, want = _produce(engine, pl, SRC, [layer])
            hs = p.send_layer(peer, "s", layer, SRC, after=event)
            wants.append(want)
        hr.wait(T)
        for layer, want in enumerate(wants):
            assert _same(want, SRC, dl, DST, layers=[layer]), layer
        hs.wait(T)
    finally:
        p.close()
        d.close()
        engine.close()
    assert not engine.errors


def test_staging_slice_reused_only_after_the_scatter():
    """Many chunks through a small staging ring with a slow scatter on D: a slice freed
    (and re-granted to the next chunk) before its unpack ran would be overwritten first."""
    p, d, pl, dl, peer, devices = _agents("pack", p_delay=0.0, d_delay=0.08, staging=24 << 10)
    try:
        src = make_pool("2 N B H D", 3)
        for layer in range(pl.num_layers):
            for kv in range(pl.num_kv):
                pl.kv_view(layer, kv).copy_(src.kv_view(layer, kv))
        ids, dst = list(range(0, 32, 2)), list(range(1, 32, 2))
        hr = d.recv("c", dst, timeout=T)
        p.send(peer, "c", ids).wait(T)
        hr.wait(T)
        assert _same(src, ids, dl, dst)
        assert devices[1].launched > 4  # chunked
    finally:
        p.close()
        d.close()


def test_after_type_is_checked():
    p, d, pl, dl, peer, devices = _agents("zero_copy")
    try:
        with pytest.raises(TypeError, match="DeferredEvent"):
            p.send(peer, "x", SRC, after=object())
        assert p.held_blocks() == {}
        done = DeferredEvent()
        done._set()
        hr = d.recv("y", DST, timeout=T)
        p.send(peer, "y", SRC, after=done).wait(T)
        hr.wait(T)
    finally:
        p.close()
        d.close()


def test_host_device_refuses_after_on_a_cpu_pool():
    from kvxfer.kernels.device import HostDevice, device_for

    layout = make_pool("2 N B H D", None)
    assert isinstance(device_for(layout), HostDevice)
    with pytest.raises(TypeError, match="CUDA"):
        HostDevice().capture(DeferredEvent())
    assert HostDevice().capture(None) is None


def _cuda_pool(seed):
    host = make_pool("2 N B H D", seed)
    return kvxfer.KVLayout.from_tensors([t.cuda() for t in host.tensors], "2 N B H D")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["zero_copy", "pack"])
def test_gpu_send_after_a_busy_producer_stream(path):
    """Real CUDA pools and kvxfer's CudaDevice over UCX: the engine's stream is busy
    (``torch.cuda._sleep``) before it writes the KV; ``send(after=stream)`` must wait for
    it, and D's data must be visible to work queued after its recv completed."""
    pl, dl, want = _cuda_pool(None), _cuda_pool(None), _cuda_pool(5)
    p = Agent("p", secret=SECRET, backend="ucx", config=AgentConfig(path=path))
    d = Agent("d", secret=SECRET, backend="ucx", config=AgentConfig(path=path))
    try:
        p.register_kv(pl)
        d.register_kv(dl)
        peer = p.connect(d.address)
        torch.cuda.synchronize()
        producer = torch.cuda.Stream()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(500_000_000)  # ~0.25 s of GPU clock cycles before the write
            for layer in range(pl.num_layers):
                for kv in range(pl.num_kv):
                    pl.kv_view(layer, kv)[SRC] = want.kv_view(layer, kv)[SRC]
        hr = d.recv("g", DST, timeout=T)
        hs = p.send(peer, "g", SRC, after=producer)
        hr.wait(T)
        consumer = torch.cuda.Stream()
        with torch.cuda.stream(consumer):  # work queued after completion, on another stream
            got = kvxfer.pack(dl, DST, backend="reference")
        consumer.synchronize()
        torch.cuda.synchronize()
        assert torch.equal(got, kvxfer.pack(want, SRC, backend="reference"))
        hs.wait(T)
        assert hs.path == path
    finally:
        p.close()
        d.close()
