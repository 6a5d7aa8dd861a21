"""Simulated accelerators and the planner that runs on them. See docs/simulate.md.

The simulated engine (a worker whose forward pass is a modelled time):
``cost_model`` (the step-time form) -> ``profile`` (a JSON file: hardware, model, a fit
per tensor-parallel degree, KV capacity, the profiled engine's scheduling; shipped ones
by name) -> ``distserve`` (DistServe's published fits as profiles) and ``attention``
(attention terms from a model's shape and a GPU's peaks) -> ``measure`` (how ``kvxfer
profile`` times the embedded engine) -> ``link`` (bytes over a modelled NIC, FIFO) ->
``pool`` (the scaled-down, verifiable KV pool a simulated worker registers) -> ``devices``
(modelled devices that workers share) -> ``runtime`` (the engine core whose step sleeps
for the modelled time). Everything else a simulated worker runs is the real serving stack.

The planner (no processes, no sleeping): ``configs`` (the configuration names,
``xPyD@A,B``) -> ``virtual_worker`` and ``vclock`` (a cluster of them on a virtual
clock, running the real scheduler, router and rebalancer; ``handoff`` the KV's way from
a prefill worker to a decode worker, ``store`` its KV pool) ->
``replay`` (a trace slice replayed on one configuration, scored as ``kvxfer loadgen``
scores) -> ``plan`` (each configuration's capacity per GPU under an SLO, and the search).
"""
