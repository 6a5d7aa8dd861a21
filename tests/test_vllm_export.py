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
