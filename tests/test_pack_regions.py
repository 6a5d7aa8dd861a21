"""Regions of a pool split at device allocation boundaries (an injected oracle stands in
for the CUDA driver), host pools merged as before, and the descriptors that use them."""
import numpy as np
import pytest
import torch

import kvxfer
from kvxfer.cuda_ranges import driver_allocation_range, oracle_for, split_parts, split_regions
from kvxfer.layout import KVLayout
from kvxfer.transport.descriptors import Geometry


def oracle(allocations):
    """``allocation_range`` over ``[(start, size), ...]``."""
    def allocation_range(addr):
        for start, size in allocations:
            if start <= addr < start + size:
                return start, size
        return None
    return allocation_range


def test_touching_hulls_split_only_at_allocation_starts():
    hulls = [(100, 200), (200, 300), (300, 350), (400, 500)]
    assert split_regions(hulls) == ((100, 250), (400, 100))  # no oracle: host behaviour
    two = oracle([(100, 100), (200, 150), (400, 100)])  # 200 starts an allocation, 300 does not
    assert split_regions(hulls, two) == ((100, 100), (200, 150), (400, 100))
    assert split_regions([(0, 50), (20, 80)], oracle([(0, 30), (30, 70)])) == ((0, 80),)  # overlap: one storage
    assert split_regions([(5, 9), (1, 5)], oracle([(1, 4), (5, 4)])) == ((1, 4), (5, 4))  # sorted


def test_parts_cut_at_every_boundary_inside_a_region():
    chunks = oracle([(0, 64), (64, 64), (128, 64), (192, 64)])  # expandable segments: one range, 4 chunks
    assert split_parts(((10, 180),), chunks) == (((10, 54), (64, 64), (128, 62)),)
    assert split_parts(((10, 180),)) == (((10, 180),),)
    assert split_parts(((10, 20), (300, 5)), chunks) == (((10, 20),), ((300, 5),))  # unknown: whole


def _back_to_back(layers=3, blocks=5):
    """Per-layer tensors whose storages touch (distinct storages over one numpy buffer)."""
    buf = np.random.default_rng(0).integers(0, 255, (layers, 2, blocks, 2, 2, 4), dtype=np.uint8)
    tensors = [torch.from_numpy(buf[i]).view(torch.float16) for i in range(layers)]
    return KVLayout.from_tensors(tensors, "2 N B H D"), tensors


def test_host_pool_keeps_one_region():
    layout, tensors = _back_to_back()
    assert oracle_for(layout.device) is None
    span = tensors[0].numel() * 2
    assert layout.regions() == ((tensors[0].data_ptr(), 3 * span),)
    assert layout.region_parts() == (((tensors[0].data_ptr(), 3 * span),),)


def test_allocation_per_layer_gives_region_per_layer(monkeypatch):
    from kvxfer import runs

    layout, tensors = _back_to_back()
    span = tensors[0].numel() * 2
    per_layer = oracle([(t.data_ptr(), span) for t in tensors])
    regions = layout.regions(per_layer)
    assert regions == tuple((t.data_ptr(), span) for t in tensors)
    assert layout.region_parts(per_layer) == tuple((r,) for r in regions)
    real = runs.regions
    monkeypatch.setattr(runs, "regions", lambda lay, allocation_range=None: real(lay, per_layer))
    # block runs and the peer's geometry name each layer's own region, offsets inside it
    block_runs = layout.block_runs([3, 1])
    assert set(block_runs[:, 0].tolist()) == {0, 1, 2}
    assert all(0 <= off and off + n <= span for off, n in block_runs[:, [1, 3]].tolist())
    geometry = Geometry.from_layout(layout)
    assert geometry.region_sizes == (span,) * 3
    assert [p[0] for p in geometry.planes] == [0, 0, 1, 1, 2, 2]
    assert Geometry.from_wire(geometry.to_wire()) == geometry


def test_one_tensor_over_chunks_is_one_region_of_several_parts():
    pool = torch.zeros(4, 2, 5, 2, 2, 4, dtype=torch.float16)  # one storage, "L 2 N B H D"
    layout = KVLayout.from_tensors(pool, "L 2 N B H D")
    base, nbytes = pool.data_ptr(), pool.numel() * 2
    chunk = nbytes // 4 + 6
    chunks = oracle([(base + i * chunk, chunk) for i in range(5)])
    assert layout.regions(chunks) == ((base, nbytes),)
    (parts,) = layout.region_parts(chunks)
    assert [p[0] for p in parts] == [base + i * chunk for i in range(4)]
    assert sum(n for _, n in parts) == nbytes


def test_driver_oracle_without_a_device_answers_none():
    if torch.cuda.is_available():
        t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        start, size = driver_allocation_range(t.data_ptr() + 100)
        assert start <= t.data_ptr() and t.data_ptr() + t.numel() <= start + size
    else:
        host = torch.empty(16, dtype=torch.uint8)
        assert driver_allocation_range(host.data_ptr()) is None


@pytest.mark.gpu
def test_gpu_per_layer_pool_regions_fit_allocations():
    tensors = [torch.empty(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    layout = KVLayout.vllm(tensors)
    for region in layout.region_parts():
        for addr, nbytes in region:
            start, size = driver_allocation_range(addr)
            assert start <= addr and addr + nbytes <= start + size


@pytest.mark.parametrize("path", ["zero_copy", "pack"])
def test_agents_move_pools_registered_in_parts(monkeypatch, path):
    """Pools and staging buffers cut into odd-sized parts (as with expandable segments):
    every descriptor is split at part ends on both sides (the loopback backend refuses a
    row that leaves its registered part), and the bytes arrive intact."""
    import kvxfer.agent
    import kvxfer.cuda_ranges
    from kvxfer import Agent, AgentConfig

    from agent_procs import SECRET, make_pool

    chunk = 5000
    fake = lambda device: (lambda addr: (addr - addr % chunk, chunk))  # noqa: E731
    monkeypatch.setattr(kvxfer.cuda_ranges, "oracle_for", fake)
    monkeypatch.setattr(kvxfer.agent.pool, "oracle_for", fake)
    pl, dl = make_pool("N L 2 B H D", 1), make_pool("2 N B H D", None)
    cfg = AgentConfig(path=path, staging_bytes=64 << 10)
    p = Agent("p", secret=SECRET, backend="loopback", config=cfg)
    d = Agent("d", secret=SECRET, backend="loopback", config=cfg)
    try:
        p.register_kv(pl)
        d.register_kv(dl)
        assert len(p._state.pool.parts) == 3 and len(d._state.pool.parts) == 2 + dl.num_layers  # pool(s) and both staging buffers
        peer = p.connect(d.address)
        assert peer.parts.keys() == {r for r in d._state.pool.parts if r != d._state.pool.stage_out_region}
        src, dst = [9, 3, 31, 0, 4, 17], [2, 30, 7, 11, 5, 20]
        hr = d.recv("r", dst, timeout=20)
        p.send(peer, "r", src).wait(20)
        hr.wait(20)
        assert hr.path == path
        assert torch.equal(kvxfer.pack(pl, src, backend="reference"), kvxfer.pack(dl, dst, backend="reference"))
        back = make_pool("N L 2 B H D", None)
        assert not torch.equal(kvxfer.pack(back, [1, 2], backend="reference"), kvxfer.pack(dl, dst[:2], backend="reference"))
    finally:
        p.close()
        d.close()


def test_split_descs_cuts_both_sides():
    from kvxfer.agent.pool import split_descs

    local = {1: ((1, 0, 100), (7, 100, 50))}
    remote = {4: ((4, 0, 30), (5, 30, 200))}
    descs = np.array([[1, 90, 4, 10, 40], [2, 0, 9, 0, 8]], dtype=np.int64)
    out = split_descs(descs, local, remote)
    assert out.tolist() == [[1, 90, 4, 10, 10], [7, 0, 4, 20, 10], [7, 10, 5, 0, 20], [2, 0, 9, 0, 8]]
    assert split_descs(descs, {}, {}) is descs
