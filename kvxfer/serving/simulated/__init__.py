"""The simulated engine: a serving worker whose forward pass is a modelled time (``kvxfer
serve --engine sim``, ``kvxfer worker --engine sim``). See docs/simulate.md.

``cost_model`` (the step-time form) -> ``profile`` (a JSON file: hardware, model, a fit
per tensor-parallel degree, KV capacity, the profiled engine's scheduling; shipped ones
by name, in ``profiles/``) -> ``measure`` (how ``kvxfer profile`` times the embedded
engine) -> ``link`` (bytes over a modelled NIC, FIFO) -> ``pool`` (the scaled-down,
verifiable KV pool a simulated worker registers) -> ``devices`` (modelled devices that
workers share) -> ``runtime`` (the engine core whose step sleeps for the modelled time).
Everything else a simulated worker runs is the real serving stack; the planner that
runs these engines on a virtual clock is :mod:`kvxfer.sim`.
"""
