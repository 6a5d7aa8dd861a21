"""The model: GGUF weights and tokenizer, a plain-torch Llama over a paged KV pool.

``gguf_loader -> config -> model (attention, rope) over kv_cache``; ``tokenizer``
and ``detokenize`` turn text into ids and back. Nothing here knows about requests.
"""
