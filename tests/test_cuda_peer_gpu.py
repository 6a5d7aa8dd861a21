"""Same-node peer copies between two real processes on CUDA (skipped without a GPU).

The receiver is a spawned process with its own CUDA pool; the sender maps it through
CUDA IPC and moves the request with one launch, behind a busy producer stream. Also:
the driver-level export/open of one allocation, and the bounds check against the size
the driver actually mapped.
"""
from __future__ import annotations

import multiprocessing as mp

import pytest

pytestmark = pytest.mark.gpu
T = 60.0


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(q_out, q_in, *args), daemon=True)
    proc.start()
    return proc, q_out, q_in


@pytest.mark.parametrize("p_dims,d_dims", [("2 N B H D", "2 N B H D"), ("L N 2 B H D", "2 N B H D")])
def test_two_processes_one_launch_bitwise(p_dims, d_dims):
    import torch

    import kvxfer
    from kvxfer import Agent

    from cuda_peer_procs import SECRET, cuda_pool, receiver

    src_ids, dst_ids = [5, 0, 63, 17, 2], [9, 40, 1, 33, 12]
    proc, q_out, q_in = _spawn(receiver, d_dims, dst_ids)
    try:
        address = q_out.get(timeout=T)
        pool, want = cuda_pool(None, p_dims), cuda_pool(3, p_dims)
        with Agent("p", secret=SECRET, backend="ucx") as agent:
            agent.register_kv(pool)
            peer = agent.connect(address)
            assert peer.device_transport == "cuda_peer"
            producer = torch.cuda.Stream()
            with torch.cuda.stream(producer):
                torch.cuda._sleep(200_000_000)  # the KV is written well after send() returns
                for layer in range(pool.num_layers):
                    for kv in range(pool.num_kv):
                        pool.kv_view(layer, kv)[src_ids] = want.kv_view(layer, kv)[src_ids]
            h = agent.send(peer, "r", src_ids, after=producer)
            h.wait(T)
            assert h.path == "cuda_peer" and peer.link.state == "mapped"
            path, got = q_out.get(timeout=T)
            assert path == "zero_copy"
            assert torch.equal(got, kvxfer.pack(want, src_ids, backend="reference").cpu())
            q_in.put("done")
    finally:
        proc.join(T)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_ipc_open_maps_the_allocation_and_refuses_a_region_beyond_it():
    import torch

    from kvxfer.transport import cuda_peer
    from kvxfer.transport.descriptors import Geometry

    from cuda_peer_procs import cuda_pool, exporter

    proc, q_out, q_in = _spawn(exporter)
    try:
        handle, offset, nbytes, size = q_out.get(timeout=T)
        ipc = cuda_peer.CudaIpc()
        cache = cuda_peer.HandleCache()
        addr, mapped = cache.acquire(ipc, handle, torch.device("cuda", 0))
        assert mapped == size >= offset + nbytes
        storage = torch._C._construct_storage_from_data_pointer(addr + offset, torch.device("cuda", 0), nbytes)
        seen = torch.empty(0, dtype=torch.int32, device="cuda").set_(storage, 0, (nbytes // 4,), (1,))
        assert torch.equal(seen, torch.arange(nbytes // 4, dtype=torch.int32, device="cuda"))
        like = cuda_pool(None, "N 2 B H D")
        geo = Geometry.from_layout(like)
        offer = {"node": cuda_peer.node_id(), "device": "",
                 "regions": tuple((handle, size - 64, n) for n in geo.region_sizes)}  # claims past the end
        with pytest.raises(cuda_peer.PeerMapError, match="outside its allocation"):
            cuda_peer.open_peer_pool(ipc, offer, geo, like, cache)
        cache.release(ipc, handle, torch.device("cuda", 0))
        assert len(cache) == 0
        q_in.put("done")
    finally:
        proc.join(T)
        if proc.is_alive():
            proc.kill()
