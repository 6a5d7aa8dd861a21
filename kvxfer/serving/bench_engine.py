"""Measure the engine's prefill and decode throughput (tokens per second).

    python -m kvxfer.serving.bench_engine --threads 1 [--model PATH.gguf]

Prefill: one prompt of ``--prompt-len`` tokens in one step. Decode: greedy
steps over a batch of ``--batch`` sequences (tok/s counts all sequences).
"""
from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Llama-family GGUF (default: embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)

    from .attention import Chunk
    from .config import EngineConfig
    from .engine import Engine

    engine = Engine(EngineConfig(model_path=args.model, num_blocks=256, num_threads=args.threads))
    model, bs = engine.model, engine.config.block_size
    ids = [(i * 7919) % 40000 + 100 for i in range(args.prompt_len)]
    table = tuple(range(-(-(args.prompt_len + args.steps) // bs)))
    model.forward([Chunk(ids[:32], 0, table)])  # warm-up
    began = time.perf_counter()
    model.forward([Chunk(ids, 0, table)])
    prefill = args.prompt_len / (time.perf_counter() - began)
    print(f"threads={args.threads} prefill {args.prompt_len} tokens: {prefill:.0f} tok/s")
    for batch in args.batch:
        per_seq = -(-(64 + args.steps) // bs)
        tables = [tuple(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
        for t in tables:
            model.forward([Chunk(ids[:64], 0, t)])
        began = time.perf_counter()
        for step in range(args.steps):
            model.forward([Chunk([ids[step]], 64 + step, t) for t in tables])
        decode = batch * args.steps / (time.perf_counter() - began)
        print(f"threads={args.threads} decode batch {batch}: {decode:.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
