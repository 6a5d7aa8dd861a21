"""Reference serving stack: real model, paged KV pool, block manager, scheduler, engine.

Subpackages, in data-flow order::

    model/    gguf_loader -> config -> model (attention, rope) over kv_cache; tokenizer
    engine/   sequence -> block_manager -> scheduler -> engine (sampling)
    workers/  one process per role (prefill, decode, colocated), one kvxfer.Agent each
    server/   router (HTTP) -> dispatch -> launcher / remote, over ipc / netchannel

Everything heavy (torch, gguf, tokenizers) is imported lazily by the modules
that need it; ``import kvxfer.serving`` alone loads nothing heavy. Import what
you use from its module, e.g. ``from kvxfer.serving.engine.engine import Engine``.
"""
