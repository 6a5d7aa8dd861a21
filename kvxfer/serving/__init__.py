"""Reference serving stack: real model, paged KV pool, block manager, scheduler, engine.

Data flow (one concept a module)::

    gguf_loader -> config -> model (attention, rope) over kv_cache
    tokenizer -> sequence -> block_manager -> scheduler -> engine (sampling, detokenize)

Everything heavy (torch, gguf, tokenizers) is imported lazily by the modules
that need it; ``import kvxfer.serving`` alone loads nothing heavy.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "ModelConfig": "kvxfer.serving.config",
    "EngineConfig": "kvxfer.serving.config",
    "SamplingParams": "kvxfer.serving.sampling",
    "Engine": "kvxfer.serving.engine",
    "TokenEvent": "kvxfer.serving.engine",
    "Chunk": "kvxfer.serving.attention",
    "KVCache": "kvxfer.serving.kv_cache",
    "LlamaModel": "kvxfer.serving.model",
    "Tokenizer": "kvxfer.serving.tokenizer",
    "BlockManager": "kvxfer.serving.block_manager",
    "Scheduler": "kvxfer.serving.scheduler",
    "Sequence": "kvxfer.serving.sequence",
    "default_model_path": "kvxfer.serving.gguf_loader",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
