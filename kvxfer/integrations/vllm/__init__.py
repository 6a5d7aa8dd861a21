"""kvxfer inside vLLM: ``KVXferConnector``, a vLLM v1 KV connector (docs/vllm.md).

vLLM names it by this package (``"kv_connector_module_path": "kvxfer.integrations.vllm"``,
``"kv_connector": "KVXferConnector"``), so the connector is importable from here; it is
loaded on first use, so the modules that need no vLLM (:mod:`.proxy`, :mod:`.config`,
:mod:`.tp`) import without it.

The modules, in the order a request meets them: :mod:`.connector` (the class vLLM
builds, per rank and for the scheduler), :mod:`.api` (the base-class check that decides
which vLLM it runs on), :mod:`.config` (``kv_connector_extra_config``), :mod:`.scheduler`
(what moves; P's block leases), :mod:`.meta` (what the scheduler tells the workers),
:mod:`.worker` (each rank's kvxfer Agent), :mod:`.tp` (which kv heads each rank holds),
:mod:`.outbound` (a P rank's sends to every D rank that needs its heads),
:mod:`.layout` (vLLM's CPU pool as a KVLayout), :mod:`.pool` (the shared KV pool),
:mod:`.prom` (counters on ``/metrics``), :mod:`.proxy` (``kvxfer proxy``) and
:mod:`.demo` (``make demo-vllm``).
"""
from __future__ import annotations

__all__ = ["KVXferConnector", "KVXferStats"]


def __getattr__(name: str):
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
