"""Child-process bodies for the two-process CUDA peer tests (spawned, so importable)."""
from __future__ import annotations

SECRET = b"test-secret-0123456789"
DIMS = "2 N B H D"
SHAPE = dict(L=4, N=64, B=16, H=8, D=128)


def cuda_pool(seed, dims=DIMS):
    """A CUDA pool of ``dims`` (bf16 bits from ``seed``, zeros if None) on the current device."""
    import torch

    from kvxfer import KVLayout

    s = SHAPE
    sizes = {"L": s["L"], "N": s["N"], "2": 2, "B": s["B"], "H": s["H"], "D": s["D"]}
    letters = dims.split()
    shape = [sizes[c] for c in letters]
    g = torch.Generator().manual_seed(seed or 0)

    def one():
        if seed is None:
            return torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        return torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=g).cuda().view(torch.bfloat16)

    tensors = one() if "L" in letters else [one() for _ in range(s["L"])]
    return KVLayout.from_tensors(tensors, dims)


def receiver(q_out, q_in, dims, ids, device_index=0):
    """D: a zeroed CUDA pool on ``device_index``; recv ``r`` into ``ids``; report its bytes."""
    import torch

    import kvxfer
    from kvxfer import Agent

    torch.cuda.set_device(device_index)
    pool = cuda_pool(None, dims)
    with Agent("d", secret=SECRET, backend="ucx") as agent:
        agent.register_kv(pool)
        q_out.put(agent.address)
        h = agent.recv("r", ids, timeout=60.0)
        h.wait(60.0)
        torch.cuda.synchronize()
        q_out.put((h.path, kvxfer.pack(pool, ids, backend="reference").cpu()))
        q_in.get(timeout=60)  # keep the pool alive until the sender is done with it


def exporter(q_out, q_in):
    """Export one allocation's IPC handle; keep it alive until told."""
    import torch

    from kvxfer.transport.cuda_peer import CudaIpc

    t = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    handle, start, size = CudaIpc().export(t.data_ptr(), 0)
    q_out.put((handle, t.data_ptr() - start, t.numel() * 4, size))
    q_in.get(timeout=60)
