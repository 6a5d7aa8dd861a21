"""Reference serving stack: real model, paged KV pool, block manager, scheduler, engine.

Subpackages, in data-flow order::

    model/    gguf_loader -> config -> model (attention, rope) over kv_cache; tokenizer
    engine/   sequence -> block_manager -> scheduler -> engine (sampling)
    workers/  one process per role (prefill, decode, colocated), one kvxfer.Agent each
    server/   router (HTTP) -> dispatch -> launcher / remote, over ipc / netchannel

Everything heavy (torch, gguf, tokenizers) is imported lazily by the modules
that need it; ``import kvxfer.serving`` alone loads nothing heavy.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "ModelConfig": "kvxfer.serving.model.config",
    "EngineConfig": "kvxfer.serving.engine.config",
    "SamplingParams": "kvxfer.serving.engine.sampling",
    "Engine": "kvxfer.serving.engine.engine",
    "TokenEvent": "kvxfer.serving.engine.engine",
    "Chunk": "kvxfer.serving.model.attention",
    "KVCache": "kvxfer.serving.model.kv_cache",
    "LlamaModel": "kvxfer.serving.model.model",
    "Tokenizer": "kvxfer.serving.model.tokenizer",
    "BlockManager": "kvxfer.serving.engine.block_manager",
    "Scheduler": "kvxfer.serving.engine.scheduler",
    "Sequence": "kvxfer.serving.engine.sequence",
    "default_model_path": "kvxfer.serving.model.gguf_loader",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
