"""Zero-copy descriptors (coalescing), pack chunks, the cost model and the staging allocator."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvxfer.agent.pool import ALIGN, StagingRing
from kvxfer.transport.descriptors import Geometry, coalesce, count_runs, zero_copy_descs
from kvxfer.transport.paths import CostModel, pack_chunks

from agent_procs import make_pool


def _copy_by_descs(src_layout, dst_layout, descs):
    """Apply descriptors with numpy over the two pools' region bytes (a reference mover)."""
    import ctypes

    def spans(layout):  # numpy views of each registered region (the pools stay alive meanwhile)
        return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)) for addr, n in layout.regions()]

    s, d = spans(src_layout), spans(dst_layout)
    for sr, so, dr, do, n in descs:
        d[dr][do:do + n] = s[sr][so:so + n]


@pytest.mark.parametrize("p_dims,d_dims,heads", [("2 N B H D", "2 N B H D", (0, 4)), ("2 N B H D", "N 2 H B D", (0, 4)),
                                                 ("N 2 H B D", "N 2 H B D", (0, 4)), ("N L 2 B H D", "2 N B H D", (0, 4)),
                                                 ("N L 2 B H D", "N L 2 B H D", (0, 4))])
def test_zero_copy_descriptors_move_exactly_the_blocks(p_dims, d_dims, heads):
    import kvxfer

    src, dst = make_pool(p_dims, 3), make_pool(d_dims, None)
    gs, gd = Geometry.from_layout(src), Geometry.from_layout(dst)
    sids, dids = [5, 6, 7, 0], [9, 10, 11, 3]
    regions = list(range(len(gs.region_sizes)))
    descs = zero_copy_descs(gs, sids, gd, dids, range(src.num_layers), heads, regions,
                            list(range(len(gd.region_sizes))))
    assert descs[:, 4].sum() == src.wire_nbytes(len(sids))
    assert len(descs) <= count_runs(gs, gd, len(sids), range(src.num_layers), heads)
    _copy_by_descs(src, dst, descs)
    assert (kvxfer.pack(src, sids, backend="reference") == kvxfer.pack(dst, dids, backend="reference")).all()


def test_same_layout_consecutive_blocks_coalesce_to_few_runs():
    src = make_pool("2 N B H D", 1)
    g = Geometry.from_layout(src)
    regions = list(range(len(g.region_sizes)))
    descs = zero_copy_descs(g, [4, 5, 6, 7], g, [10, 11, 12, 13], range(4), (0, 4), regions, regions)
    assert len(descs) == src.num_layers * 2  # one run per (layer, kv): 4 blocks merged


def test_blocks_whose_planes_touch_coalesce_block_major():
    # "N L 2 B H D" on both sides: a block's layers and K/V are one run, so scattered
    # blocks give one descriptor per block, and consecutive ones merge further.
    src, dst = make_pool("N L 2 B H D", 1), make_pool("N L 2 B H D", None)
    gs, gd = Geometry.from_layout(src), Geometry.from_layout(dst)
    regions = list(range(len(gs.region_sizes)))
    scattered = zero_copy_descs(gs, [7, 2, 5], gd, [1, 6, 3], range(src.num_layers), (0, 4), regions, regions)
    assert len(scattered) == 3 and set(scattered[:, 4]) == {src.block_nbytes() * src.num_layers}
    consecutive = zero_copy_descs(gs, [4, 5, 6], gd, [0, 1, 2], range(src.num_layers), (0, 4), regions, regions)
    assert len(consecutive) == 1


def test_coalesce_only_merges_runs_contiguous_on_both_sides():
    d = np.array([[1, 0, 2, 0, 8], [1, 8, 2, 8, 8], [1, 16, 2, 32, 8], [1, 24, 3, 40, 8]], dtype=np.int64)
    assert coalesce(d).tolist() == [[1, 0, 2, 0, 16], [1, 16, 2, 32, 8], [1, 24, 3, 40, 8]]


def test_pack_chunks_cover_everything_within_the_limit():
    pieces = pack_chunks(10, (0, 1, 2), 100, 450)
    covered = [(l, i) for lay, sl in pieces for l in lay for i in range(10)[sl]]
    assert sorted(covered) == [(l, i) for l in range(3) for i in range(10)]
    assert all(len(lay) * len(range(10)[sl]) * 100 <= 450 for lay, sl in pieces)
    with pytest.raises(ValueError):
        pack_chunks(1, (0,), 1000, 10)


def test_cost_model_prefers_pack_for_short_runs():
    cm = CostModel(per_desc_us=0.75, pack_gbps=4.0, stage_rtt_us=500.0)
    assert cm.choose(num_descs=8192, nbytes=268 << 20) == "zero_copy"  # 32 KiB runs
    assert cm.choose(num_descs=1 << 20, nbytes=268 << 20) == "pack"  # 256 B runs


def test_gpu_pools_pack_many_cuda_ipc_puts_and_keep_long_runs_zero_copy():
    """The H200 figures behind device_cost: a 2,048-token Llama-3-8B request moved as 8,192
    cuda_ipc puts of 32 KiB costs ~56 ms, packed ~6 ms, so a GPU pool packs it; whole
    layers in long runs stay zero-copy, and host pools keep the host model's choice."""
    from kvxfer.transport.paths import device_cost

    host = CostModel(per_desc_us=0.75)
    gpu = device_cost(host, "ucx:cuda_ipc")
    nbytes = 256 << 20
    assert host.choose(8192, nbytes) == "zero_copy"  # host memory: 8,192 runs beat two CPU copies
    assert gpu.choose(8192, nbytes) == "pack"
    assert gpu.choose(64, nbytes) == "zero_copy"  # 4 MiB runs: few puts
    assert device_cost(host, "ucx:rc_mlx5").per_desc_us == host.per_desc_us  # no cuda_ipc lane


# ucp_ep_print_info's lanes of two processes on one H200 (UCX 1.22, 2026-12-04)
H200_LANES = """\
#                 lane[0]:  2:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] seg 4294967295 am keepalive
#                 lane[1]:  3:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255] seg 4294967295
#                 lane[2]:  6:cma/memory.0 md[6]            -> md[6]/cma/sysdev[255] seg 4294967295 rma_bw#1
#                 lane[3]:  5:cuda_ipc/cuda.0 md[5]         -> md[5]/cuda_ipc/sysdev[0] seg 4294967295 rma_bw#0
"""


def test_the_lane_that_carries_gpu_memory_is_reported():
    """UCX moved the H200's GPU-to-GPU puts on cuda_ipc while the endpoint's host lane is cma:
    a connection reports both; without a CUDA IPC lane the device lane is the host one."""
    from kvxfer.transport.ucx import UcxConnection, rma_lanes

    assert rma_lanes(H200_LANES) == ["cma", "cuda_ipc"]
    conn = UcxConnection(peer_id=1, transport="ucx:cma", ucx_info=H200_LANES)
    assert (conn.transport, conn.device_transport) == ("ucx:cma", "ucx:cuda_ipc")
    host_only = "\n".join(line for line in H200_LANES.splitlines() if "cuda_ipc" not in line)
    assert UcxConnection(peer_id=2, transport="ucx:cma", ucx_info=host_only).device_transport == "ucx:cma"
    assert UcxConnection(peer_id=3, transport="vm").device_transport == "vm"


def test_staging_ring_alloc_free_fifo_and_close():
    ring = StagingRing(4 * ALIGN)
    a, b = ring.alloc(ALIGN, 1.0), ring.alloc(2 * ALIGN, 1.0)
    assert (a, b) == (0, ALIGN) and ring.used_bytes == 3 * ALIGN
    granted = []
    ring.alloc_async(2 * ALIGN, granted.append)  # does not fit yet: queued
    ring.alloc_async(ALIGN, granted.append)  # FIFO: waits behind the first
    assert granted == []
    ring.free(a)
    assert granted == []
    ring.free(b)
    assert granted == [0, 2 * ALIGN]
    with pytest.raises(ValueError):
        ring.alloc(5 * ALIGN)
    assert ring.alloc(4 * ALIGN, 0.01) is None  # full: times out
    result = []
    t = threading.Thread(target=lambda: result.append(ring.alloc(4 * ALIGN, 30.0)))
    t.start()
    ring.close()
    t.join(30.0)
    assert result == [None]
