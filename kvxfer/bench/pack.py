"""``kvxfer bench pack``: pack/unpack GB/s per model shape vs a same-run contiguous copy.

For each model shape and block count, a pool of ``1.25 x blocks`` blocks is
allocated (vLLM per-layer ``[2, N, B, H, D]`` by default), ``blocks`` random
block ids in random order are packed into a wire buffer and unpacked back; the
limit is a contiguous copy of the same number of bytes with the same resources
(CPU: :class:`~kvxfer.bench.copy_limit.MemcpyLimit` on the kernels' thread count,
with non-temporal stores where the kernels use them, from 32 MiB; GPU: ``copy_``
device to device). Ratios are median pack (unpack) GB/s over median copy GB/s.
"""
from __future__ import annotations

import time

MODELS = {  # name: (layers, kv heads, head dim, block size)
    "Llama-3-8B": (32, 8, 128, 16),
    "Llama-3-70B": (80, 8, 128, 16),
    "SmolLM2-135M": (30, 3, 64, 16),
}
LAYOUTS = {"vllm": "2 N B H D", "hnd": "2 N H B D", "cross": "N L 2 B H D"}
COLUMNS = [("model", "model"), ("blocks", "blocks"), ("MiB", "mib"), ("run KiB", "run_kib"),
           ("pack GB/s", "pack_gbps"), ("unpack GB/s", "unpack_gbps"), ("copy GB/s", "copy_gbps"),
           ("pack/copy", "pack_ratio"), ("unpack/copy", "unpack_ratio"),
           ("torch pack", "torch_pack_gbps"), ("torch unpack", "torch_unpack_gbps")]


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="128 blocks, few iterations (what `make bench` runs)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (Triton kernels)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--blocks", default="128,1024", help="comma-separated block counts")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="vllm", help="engine pool layout")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per figure (CPU)")
    parser.add_argument("--max-gib", type=float, default=6.0, help="skip shapes whose buffers exceed this")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch-path comparison columns")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and environment as JSON")


def _make_layout(model: str, num_blocks: int, layout: str, device: str):
    import torch

    from .. import KVLayout

    layers, heads, head_dim, block = MODELS[model]
    size = {"L": layers, "2": 2, "N": num_blocks, "B": block, "H": heads, "D": head_dim}
    dims = LAYOUTS[layout].split()
    shape = [size[d] for d in dims]
    if "L" in dims:
        tensors = torch.empty(shape, dtype=torch.bfloat16, device=device).fill_(1.0)
    else:
        tensors = [torch.empty(shape, dtype=torch.bfloat16, device=device).fill_(1.0) for _ in range(layers)]
    return KVLayout.from_tensors(tensors, " ".join(dims))


def _cpu_seconds(fns: dict, iters: int, warmup: int = 2) -> dict:
    """Seconds per call of each fn, measured in interleaved rounds so that load from
    other processes spreads over all of them alike (the ratios stay meaningful)."""
    samples = {key: [] for key in fns}
    for i in range(warmup + iters):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                samples[key].append(time.perf_counter() - t0)
    return samples


def _gpu_seconds(fn) -> list:
    import triton.testing

    return [ms / 1e3 for ms in triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="all")]


def measure(model: str, num_blocks: int, args) -> dict:
    import numpy as np
    import torch

    from .. import kernels
    from ..report.stats import gbps, summarize
    from . import resources
    from .copy_limit import MemcpyLimit

    pool_blocks = num_blocks + num_blocks // 4
    layout = _make_layout(model, pool_blocks, args.layout, args.device)
    ids = torch.from_numpy(np.random.default_rng(0).choice(pool_blocks, num_blocks, replace=False))
    nbytes = layout.wire_nbytes(num_blocks)
    wire = torch.empty(nbytes, dtype=torch.uint8, device=args.device).fill_(1)
    gpu = args.device != "cpu"
    if gpu:
        dst = torch.empty_like(wire).fill_(2)
        copy = lambda: dst.copy_(wire)  # noqa: E731
    else:
        res = resources.for_path("local", nbytes, path="pack")
        limit = MemcpyLimit(nbytes, threads=res.threads, streaming=res.streaming)
        copy = limit.sample
    fns = {
        "copy": copy,
        "pack": lambda: kernels.pack(layout, ids, out=wire),
        "unpack": lambda: kernels.unpack(layout, wire, ids),
    }
    if not args.no_torch:
        fns["torch_pack"] = lambda: kernels.pack(layout, ids, out=wire, backend="torch")
        fns["torch_unpack"] = lambda: kernels.unpack(layout, wire, ids, backend="torch")
    if gpu:
        times = {key: _gpu_seconds(fn) for key, fn in fns.items()}
    else:
        times = _cpu_seconds(fns, args.iters)
    row = {"model": model, "blocks": num_blocks, "mib": round(nbytes / 2**20, 1), "layout": args.layout,
           "run_kib": int(layout.block_runs(ids[:1])[:, 3].max()) / 1024, "device": args.device,
           "samples_s": times}
    for key, samples in times.items():
        row[f"{key}_gbps"] = gbps(nbytes, summarize(samples).median)
    row["pack_ratio"] = row["pack_gbps"] / row["copy_gbps"]
    row["unpack_ratio"] = row["unpack_gbps"] / row["copy_gbps"]
    return row


def run(args) -> int:
    from .. import report
    from ..report import envinfo

    if args.quick:
        args.blocks, args.iters = "128", min(args.iters, 5)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    blocks = [int(b) for b in args.blocks.split(",")]
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: no CUDA device here")
    warning, load0 = envinfo.busy_warning(), envinfo.load_average()
    if warning:
        report.warn(warning)
    rows, todo = [], [(m, b) for m in models for b in blocks]
    with report.progress(len(todo), "pack/unpack") as advance:
        for model, num_blocks in todo:
            layers, heads, head_dim, block = MODELS[model]
            wire_gib = layers * num_blocks * 2 * block * heads * head_dim * 2 / 2**30
            need = wire_gib * 4.25  # pool (1.25x) + wire + the copy limit's two buffers
            if need > args.max_gib:
                report.warn(f"skipping {model} x {num_blocks} blocks: needs {need:.1f} GiB "
                            f"(> --max-gib {args.max_gib})")
            else:
                rows.append(measure(model, num_blocks, args))
            advance()
    backend = "triton" if args.device != "cpu" else "native C++"
    out = report.console(min_width=150)
    report.print_table(f"kvxfer pack/unpack ({backend}, {args.layout} pool, bf16, {args.device})", COLUMNS, rows,
                       caption="GB/s = 1e9 B/s, medians; copy = contiguous copy of the same bytes, same run", out=out)
    if args.json:
        report.write_json(args.json, benchmark="pack", args=vars(args) | {"func": None},
                          environment=envinfo.collect(load_average_at_start=list(load0)), rows=rows)
    return 0
