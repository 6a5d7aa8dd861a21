"""Export a Llama-family GGUF (default: the embedded SmolLM2-135M-Instruct) as a
Hugging Face directory that vLLM (or transformers) loads offline.

What changes on the way (everything else is a rename):

* quantized tensors are dequantized (fp32), then cast to ``dtype``;
* llama.cpp stores ``attn_q``/``attn_k`` rows permuted for Meta's interleaved
  rotary (pairs ``(2i, 2i+1)``); HF Llama rotates halves ``(i, i + D/2)``, so
  the permutation is undone on q_proj and k_proj only:
  ``w.reshape(n_head, D/2, 2, in).transpose(1, 2).reshape(out, in)``;
* tied embeddings stay tied (no ``lm_head.weight``, ``tie_word_embeddings``);
* with ``tp=N`` (:func:`pad_heads`), kv heads are added until ``N`` divides them, as
  copies of the last heads whose share of ``o_proj`` is split between original and
  copy: the same function, servable with ``tensor_parallel_size=N`` (SmolLM2's 9
  query and 3 kv heads otherwise allow only 1, 3 or 9);
* ``config.json`` comes from the ``llama.*`` metadata, ``tokenizer.json`` from
  ``tokenizer.ggml.*`` through :class:`kvxfer.serving.model.tokenizer.Tokenizer`, and
  the chat template goes into ``tokenizer_config.json``.

Example::

    export_hf("/tmp/smollm2-hf", dtype="bfloat16")   # then: vllm serve /tmp/smollm2-hf
"""
from __future__ import annotations

import json
import os

DTYPES = ("bfloat16", "float32", "float16")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def unpermute_rotary(w, num_heads: int):
    """Undo llama.cpp's q/k row permutation: ``w`` ``[num_heads * D, in]`` -> same shape,
    rows of each head reordered from interleaved pairs to HF's rotate-half order."""
    out, inp = w.shape
    head_dim = out // num_heads
    if head_dim * num_heads != out or head_dim % 2:
        raise ValueError(f"cannot split {out} rows into {num_heads} heads of even size")
    return w.reshape(num_heads, head_dim // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def pad_heads(state: dict, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
              multiple: int) -> tuple:
    """Add kv heads (fp32 HF weights, in place) until ``multiple`` divides their count.

    Kv head ``j`` serves query heads ``[j*g, (j+1)*g)`` (``g = num_heads // num_kv_heads``).
    Each added kv head copies one of the last heads' ``k_proj``/``v_proj`` rows and its
    group's ``q_proj`` rows; both the original group's and the copy's ``o_proj`` columns
    are scaled by ``1 / copies``, so the attention output is the same sum of the same
    terms, and every kv head -- copies too -- still matters to it.
    Returns ``(num_heads, num_kv_heads)`` after padding."""
    import torch

    if multiple < 1:
        raise ValueError(f"tp must be >= 1, got {multiple}")
    new_kv = -(-num_kv_heads // multiple) * multiple
    if new_kv == num_kv_heads and num_heads % multiple == 0:
        return num_heads, num_kv_heads
    g = num_heads // num_kv_heads
    sources = [(num_kv_heads - (new_kv - num_kv_heads) + i) % num_kv_heads for i in range(new_kv - num_kv_heads)]
    copies = [1 + sources.count(j) for j in range(num_kv_heads)]
    for i in range(num_layers):
        pre = f"model.layers.{i}.self_attn."

        def rows(w, heads, per):  # the row blocks of ``heads``, ``per`` rows each
            return [w[h * per:(h + 1) * per] for h in heads]

        for name in ("k_proj", "v_proj"):
            w = state[pre + name + ".weight"]
            state[pre + name + ".weight"] = torch.cat([w, *rows(w, sources, head_dim)])
        q = state[pre + "q_proj.weight"]
        state[pre + "q_proj.weight"] = torch.cat([q, *rows(q, sources, g * head_dim)])
        o = state[pre + "o_proj.weight"].clone()
        for j in range(num_kv_heads):
            o[:, j * g * head_dim:(j + 1) * g * head_dim] /= copies[j]
        added = [o[:, j * g * head_dim:(j + 1) * g * head_dim] for j in sources]
        state[pre + "o_proj.weight"] = torch.cat([o, *added], dim=1)
    return new_kv * g, new_kv


def hf_state_dict(weights: dict, config, dtype) -> dict:
    """GGUF-named fp32 weights -> HF Llama names in ``dtype`` (contiguous tensors)."""
    out = {"model.embed_tokens.weight": weights["token_embd.weight"],
           "model.norm.weight": weights["output_norm.weight"]}
    if not config.tied_embeddings:
        out["lm_head.weight"] = weights["output.weight"]
    for i in range(config.num_layers):
        for src, dst in _LAYER_NAMES.items():
            w = weights[f"blk.{i}.{src}"]
            if src == "attn_q.weight":
                w = unpermute_rotary(w, config.num_heads)
            elif src == "attn_k.weight":
                w = unpermute_rotary(w, config.num_kv_heads)
            out[f"model.layers.{i}.{dst}"] = w
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def hf_config(config, tok, dtype: str, heads: tuple | None = None) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with the GGUF's hyperparameters
    (``heads``: ``(num_heads, num_kv_heads)`` after :func:`pad_heads`)."""
    num_heads, num_kv_heads = heads or (config.num_heads, config.num_kv_heads)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": config.head_dim,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position,
        "rope_theta": config.rope_theta, "rope_scaling": None, "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": config.tied_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "torch_dtype": dtype,
    }


def _token(tokens, idx):
    return None if idx is None or not 0 <= idx < len(tokens) else tokens[idx]


def export_hf(out_dir: str, *, model_path: str | None = None, dtype: str = "bfloat16", tp: int = 1) -> str:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json`` and ``generation_config.json``
    into ``out_dir`` (created; existing files there are overwritten). Returns ``out_dir``.

    ``model_path``: a Llama GGUF (default: the embedded SmolLM2). ``dtype``: one of
    :data:`DTYPES`. ``tp``: pad the heads so ``tensor_parallel_size=tp`` splits them
    (:func:`pad_heads`; the same function). Raises ``ValueError`` for an unsupported
    dtype or model.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    import torch
    from safetensors.torch import save_file

    from ..serving.model.gguf_loader import load_weights, metadata, open_gguf, read_model_config
    from ..serving.model.tokenizer import Tokenizer

    reader = open_gguf(model_path)
    config = read_model_config(reader)
    tok = Tokenizer.from_gguf(reader)
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    state = hf_state_dict(load_weights(reader, config), config, torch.float32)
    heads = pad_heads(state, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim, tp)
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save_json(os.path.join(out_dir, "tokenizer.json"))
    bos, eos = _token(tokens, tok.bos_id), _token(tokens, tok.eos_id)
    files = {
        "config.json": hf_config(config, tok, dtype, heads),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "unk_token": eos, "pad_token": eos, "add_bos_token": tok.add_bos, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": config.max_position,
            "chat_template": tok.chat_template},
        "special_tokens_map.json": {"bos_token": bos, "eos_token": eos, "unk_token": eos, "pad_token": eos},
        "generation_config.json": {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id},
    }
    for name, body in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(body, f, indent=2, ensure_ascii=False)
    return out_dir
