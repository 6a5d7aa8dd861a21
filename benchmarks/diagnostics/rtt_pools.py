"""The pools of the round-trip diagnostics (rtt_trace.py, rtt_cpu.py, spin_cpu.py):
SmolLM2's shape, ``[2, N, 16, 3, 64]`` bf16 per layer, 30 layers, as ``kvxfer bench e2e
--model smollm2-135m`` uses them."""


def pool(n=64):
    import torch

    from kvxfer import KVLayout

    t = torch.ones(2, n, 16, 3, 64, dtype=torch.bfloat16)
    return KVLayout.from_tensors([t.clone() for _ in range(30)], "2 N B H D")
