"""``kvxfer export-hf``: the rotary un-permutation, names, config and tokenizer files.
(That vLLM loads the export and matches kvxfer's model is in test_vllm_pd.py.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvxfer.integrations.hf_export import unpermute_rotary


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's permute (HF rotate-half rows -> interleaved pairs)."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp(n_head, head_dim):
    w = torch.randn(n_head * head_dim, 16)
    assert torch.equal(unpermute_rotary(llama_cpp_permute(w, n_head), n_head), w)
    with pytest.raises(ValueError):
        unpermute_rotary(torch.randn(10, 4), 3)


def test_export_files(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from kvxfer.cli import main

    assert main(["export-hf", str(tmp_path), "--dtype", "fp32"]) == 0
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in state and state["model.embed_tokens.weight"].dtype == torch.float32
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    tok_cfg = json.load(open(tmp_path / "tokenizer_config.json"))
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["eos_token"] == "<|im_end|>"
    from tokenizers import Tokenizer

    from kvxfer.serving.model.gguf_loader import open_gguf
    from kvxfer.serving.model.tokenizer import Tokenizer as Ours

    ours = Ours.from_gguf(open_gguf())
    text = "<|im_start|>user\nHello, 2024 worlds!<|im_end|>"
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == ours.encode(text)
    with pytest.raises(ValueError):
        from kvxfer.integrations.hf_export import export_hf
        export_hf(os.fspath(tmp_path / "x"), dtype="int8")


def _gqa_attention(x, q_w, k_w, v_w, o_w, num_heads, num_kv_heads, head_dim):
    """Causal GQA attention of ``x`` ``[T, in]`` with HF-layout projection weights."""
    T = x.shape[0]
    q = (x @ q_w.T).view(T, num_heads, head_dim).transpose(0, 1)
    k = (x @ k_w.T).view(T, num_kv_heads, head_dim).transpose(0, 1)
    v = (x @ v_w.T).view(T, num_kv_heads, head_dim).transpose(0, 1)
    g = num_heads // num_kv_heads
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
    att = torch.softmax(q @ k.transpose(1, 2) / head_dim ** 0.5 + mask, dim=-1)
    return (att @ v).transpose(0, 1).reshape(T, num_heads * head_dim) @ o_w.T


@pytest.mark.parametrize("tp,heads", [(2, (12, 4)), (4, (12, 4)), (3, (9, 3)), (1, (9, 3))])
def test_pad_heads_keeps_the_function(tp, heads):
    """SmolLM2's shape (9 query heads on 3 kv heads): padded for ``tp``, the heads divide
    by it and the attention output is the same (float64, to 1e-12)."""
    from kvxfer.integrations.hf_export import pad_heads

    torch.manual_seed(0)
    H, KV, D, hidden = 9, 3, 4, 12
    w = {"q_proj": torch.randn(H * D, hidden), "k_proj": torch.randn(KV * D, hidden),
         "v_proj": torch.randn(KV * D, hidden), "o_proj": torch.randn(hidden, H * D)}
    w = {k: v.double() for k, v in w.items()}
    state = {f"model.layers.0.self_attn.{k}.weight": v.clone() for k, v in w.items()}
    assert pad_heads(state, 1, H, KV, D, tp) == heads
    nh, nkv = heads
    assert nh % tp == 0 and nkv % tp == 0
    x = torch.randn(5, hidden, dtype=torch.float64)
    ref = _gqa_attention(x, *w.values(), H, KV, D)
    pw = [state[f"model.layers.0.self_attn.{k}.weight"] for k in w]
    assert torch.allclose(_gqa_attention(x, *pw, nh, nkv, D), ref, rtol=0, atol=1e-12)
    if nkv > KV:  # the copied kv head matters: zeroing it changes the output
        pw[1] = pw[1].clone()
        pw[1][(nkv - 1) * D:] = 0
        assert not torch.allclose(_gqa_attention(x, *pw, nh, nkv, D), ref, atol=1e-6)
