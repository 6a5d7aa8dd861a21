"""``kvxfer export-hf OUT_DIR``: the embedded model (or a Llama GGUF) as a Hugging Face
directory for ``vllm serve OUT_DIR`` -- no hub access needed."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("export-hf", help="write the model as a Hugging Face directory (for vLLM)",
                       description=__doc__)
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--model", default=None, metavar="PATH.gguf",
                   help="Llama-family GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16",
                   help="weight dtype in model.safetensors (default bf16)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="pad the kv heads (with copies, the same function) so vLLM's "
                        "--tensor-parallel-size N splits them (default 1: as they are)")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvxfer.integrations.hf_export import export_hf

    dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[args.dtype]
    out = export_hf(args.out_dir, model_path=args.model, dtype=dtype, tp=args.tp)
    print(f"wrote {out} ({dtype})")
    return 0
