"""Measure the engine's prefill and decode speed, and the matmul dtypes on this CPU.

    python benchmarks/serving_engine.py --threads 1 [--model PATH.gguf] [--dtypes]
        [--matmul-dtype auto|fp32|bf16]

Prefill: one prompt of ``--prompt-len`` tokens in one step. Decode: greedy
steps over a batch of ``--batch`` sequences (tok/s counts all sequences; ms per
step is the TPOT each sequence sees). ``--dtypes``: time ``F.linear`` at the
model's projection shapes in fp32, bf16, fp16 and int8 weight-only
(``torch._weight_int8pack_mm``), as ratios to fp32 (plain ``F.linear`` calls,
not the runtime's fixed-row tiles; ``--matmul-dtype`` picks what the model runs).
"""
from __future__ import annotations

import argparse
import time

from kvxfer.serving.model.config import MATMUL_DTYPES


def _time(fn, reps: int) -> float:
    fn()
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) / reps


def compare_dtypes(config, rows=(1, 4, 256), reps: int = 20) -> list[dict]:
    """Seconds per ``F.linear`` at ``[rows, in] x [out, in]`` for each dtype, by shape."""
    import torch
    import torch.nn.functional as F

    shapes = {"qkv": (config.q_size + 2 * config.kv_size, config.hidden_size),
              "gate_up": (2 * config.intermediate_size, config.hidden_size),
              "down": (config.hidden_size, config.intermediate_size)}
    out = []
    for name, (n_out, n_in) in shapes.items():
        w = torch.randn(n_out, n_in)
        w8 = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8)
        scales = torch.rand(n_out)
        for m in rows:
            x = torch.randn(m, n_in)
            row = {"shape": name, "rows": m,
                   "fp32": _time(lambda: F.linear(x, w), reps)}
            for dtype in (torch.bfloat16, torch.float16):
                xd, wd = x.to(dtype), w.to(dtype)
                row[str(dtype).split(".")[-1]] = _time(lambda: F.linear(xd, wd), reps)
            row["int8_weight_only"] = _time(lambda: torch._weight_int8pack_mm(x, w8, scales), reps)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Llama-family GGUF (default: embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default="auto",
                    help="the model's projection dtype (auto: bf16 where the CPU has AMX)")
    ap.add_argument("--dtypes", action="store_true", help="also compare matmul dtypes")
    ap.add_argument("--mixed-chunk", type=int, nargs="*", default=[], metavar="N",
                    help="decode steps of the last --batch with an N-token prompt chunk added "
                         "(the cost of prefilling N tokens on a decode worker)")
    args = ap.parse_args(argv)

    import os

    from kvxfer.serving.model.attention import Chunk
    from kvxfer.serving.engine.config import EngineConfig
    from kvxfer.serving.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=args.model, num_blocks=512, num_threads=args.threads,
                                  matmul_dtype=args.matmul_dtype))
    model, bs = engine.model, engine.config.block_size
    print(f"load average {os.getloadavg()[0]:.2f} (shared machine: figures move with it); "
          f"matmul dtype {model.matmul_dtype}")
    if args.dtypes:
        for row in compare_dtypes(engine.model_config):
            ratios = "  ".join(f"{k} {row[k] / row['fp32']:.2f}x" for k in
                               ("bfloat16", "float16", "int8_weight_only"))
            print(f"linear {row['shape']:8s} rows {row['rows']:4d}: fp32 "
                  f"{row['fp32'] * 1e3:7.3f} ms; time vs fp32: {ratios}")
    ids = [(i * 7919) % 40000 + 100 for i in range(args.prompt_len)]
    table = tuple(range(-(-(args.prompt_len + args.steps) // bs)))
    model.forward([Chunk(ids[:32], 0, table)])  # warm-up
    began = time.perf_counter()
    model.forward([Chunk(ids, 0, table)])
    prefill = args.prompt_len / (time.perf_counter() - began)
    print(f"threads={args.threads} prefill {args.prompt_len} tokens: {prefill:.0f} tok/s")
    for batch in args.batch:
        per_seq = -(-(64 + args.steps + 1) // bs)
        base = len(table)
        tables = [tuple(range(base + b * per_seq, base + (b + 1) * per_seq)) for b in range(batch)]
        for t in tables:
            model.forward([Chunk(ids[:64], 0, t)])
        model.forward([Chunk([ids[0]], 64, t) for t in tables])  # warm-up step
        began = time.perf_counter()
        for step in range(args.steps):
            model.forward([Chunk([ids[step]], 65 + step, t) for t in tables])
        per_step = (time.perf_counter() - began) / args.steps
        print(f"threads={args.threads} decode batch {batch}: {per_step * 1e3:.1f} ms/step "
              f"(TPOT), {batch / per_step:.1f} tok/s")
    for n in args.mixed_chunk:
        prompt_table = tuple(range(len(table) + len(tables) * per_seq,
                                   len(table) + len(tables) * per_seq + -(-n // bs)))
        began = time.perf_counter()
        for step in range(args.steps):
            model.forward([Chunk([ids[step]], 65 + step, t) for t in tables]
                          + [Chunk(ids[100:100 + n], 0, prompt_table)])
        mixed = (time.perf_counter() - began) / args.steps
        print(f"threads={args.threads} decode batch {batch} + {n}-token prompt chunk: "
              f"{mixed * 1e3:.1f} ms/step ({mixed / per_step:.2f}x the decode step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
