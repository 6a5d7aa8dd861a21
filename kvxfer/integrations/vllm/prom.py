"""The connector's counters on vLLM's ``/metrics`` (``kvxfer:*``, labelled like vLLM's own).

Each key of :class:`~kvxfer.integrations.vllm.KVXferStats` that vLLM hands to
``observe`` (the step's worker and scheduler counters, summed) adds to the counter
``kvxfer:<key>`` (Prometheus appends ``_total``). Pool hits (``kvxfer:store_hit_tokens``)
are apart from vLLM's own prefix-cache hits (``vllm:prefix_cache_hits``, and
``kvxfer:store_local_hit_tokens`` for the requests that consulted the pool).
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

COUNTERS = {
    "sends": "Requests whose KV this engine (P) sent to a decode engine.",
    "recvs": "Requests whose KV this engine (D) received from a prefill engine.",
    "failed": "Loads from a prefill engine that failed (recomputed or failed per kv_load_failure_policy).",
    "bytes": "Bytes moved between engines.",
    "seconds": "Seconds transfers between engines took (post to visible, summed).",
    "store_lookups": "Pool lookups (one per request admission with blocks beyond the local prefix cache).",
    "store_hit_tokens": "Prompt tokens loaded from the KV pool instead of computed.",
    "store_local_hit_tokens": "Prompt tokens of pool-consulting requests that vLLM's own prefix cache held.",
    "store_queried_tokens": "Prompt tokens of the requests that consulted the pool.",
    "store_loads": "Pool loads that completed.",
    "store_load_blocks": "Blocks loaded from the pool.",
    "store_load_disk_blocks": "Of the blocks loaded from the pool, those its nodes read back from their disk tier.",
    "store_load_failed": "Pool loads that failed (recomputed or failed per kv_load_failure_policy).",
    "store_put_blocks": "Blocks put into the pool (committed, or present already).",
    "store_put_failed": "Blocks whose put failed (node down or timed out).",
    "store_put_drops": "Computed blocks not put because store_put_blocks were in flight already.",
    "store_bytes": "Bytes moved to and from the pool.",
}


class KVXferPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict = {}  # (key, engine index) -> labelled counter
        for key, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"kvxfer:{key}", documentation=doc, labelnames=labelnames)
            for engine_idx, values in per_engine_labelvalues.items():
                self._counters[(key, engine_idx)] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            counter = self._counters.get((key, engine_idx))
            if counter is not None and value > 0:
                counter.inc(value)
