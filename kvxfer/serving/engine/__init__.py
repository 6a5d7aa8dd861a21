"""The engine: requests as sequences, KV blocks, step scheduling, sampling.

``sequence -> block_manager -> scheduler -> engine (sampling)``, configured by
:class:`~kvxfer.serving.engine.config.EngineConfig`. Runs the model of
:mod:`kvxfer.serving.model`; knows nothing about HTTP or transfers.
"""
