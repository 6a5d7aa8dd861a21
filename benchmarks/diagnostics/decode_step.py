"""One decode step of the reference model at given context lengths (decode attention cost).

    taskset -c 1 python benchmarks/diagnostics/decode_step.py 2600,200,200,200,200,200,200,200,200,200

Runs ``Model.forward`` of one one-token chunk per context length (block size 16, each
sequence on its own blocks), 3 warm-ups, then prints the median and minimum of 10 steps.
"""
from __future__ import annotations

import sys
import time


def main() -> None:
    import torch

    from kvxfer.serving.engine.config import EngineConfig
    from kvxfer.serving.engine.engine import Engine
    from kvxfer.serving.model.attention import Chunk

    torch.set_num_threads(1)
    lengths = [int(x) for x in sys.argv[1].split(",")]
    model = Engine(EngineConfig(num_blocks=1024, max_num_batched_tokens=256, num_threads=1)).model
    block = 16
    chunks, first = [], 0
    for length in lengths:
        nb = length // block + 1
        chunks.append(Chunk([5], length, tuple(range(first, first + nb))))
        first += nb
    for _ in range(3):
        model.forward(chunks)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        model.forward(chunks)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{len(lengths)} contexts (max {max(lengths)}): step median {times[5] * 1e3:.1f} ms, "
          f"min {times[0] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
