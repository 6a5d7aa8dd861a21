"""Engines that import kvxfer: the vLLM KV connector (:mod:`kvxfer.integrations.vllm`)
and the export of the embedded model as a Hugging Face directory (:mod:`.hf_export`).

Nothing here is imported by the library core; each module imports its engine lazily.
"""
