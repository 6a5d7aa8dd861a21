"""The planner: when does disaggregation pay, and how. See docs/simulate.md.

It runs the simulated engine (:mod:`kvxfer.serving.simulated`: profiles, the step-time
model, modelled links) on a virtual clock; ``distserve`` (DistServe's published fits as
profiles) and ``attention`` (attention terms from a model's shape and a GPU's peaks)
build profiles for it.

The planner (no processes, no sleeping): ``configs`` (the configuration names,
``xPyD@A,B``) -> ``virtual_worker`` and ``vclock`` (a cluster of them on a virtual
clock, running the real scheduler, router and rebalancer; ``handoff`` the KV's way from
a prefill worker to a decode worker, ``store`` its KV pool) ->
``replay`` (a trace slice replayed on one configuration, scored as ``kvxfer loadgen``
scores) -> ``plan`` (each configuration's capacity per GPU under an SLO, and the search).
"""
