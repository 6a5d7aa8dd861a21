"""The connector's use of the KV pool (``kv_connector_extra_config.store``).

Scheduler (:class:`PoolPlanner`, one :class:`kvxfer.KVStore` for lookups): for a
request vLLM's own prefix cache covers ``k`` blocks of, ``match`` looks up the
prompt's next keys (``kvxfer.block_keys(prompt, block_size, salt=model identity)``)
and reports the leading hits as external tokens loaded asynchronously (never the
prompt's last token: vLLM computes at least one). After vLLM allocated blocks, a
:class:`PoolBlocks` (a load) names the keys and the blocks they load into. Each step
(``plan_puts``), blocks that become full with tokens the engine computed in it, prompt
or generated (not those it loaded or held already), become a :class:`PoolBlocks` (a
put), sent to the worker with the step: a conversation's next turn, whose prompt
repeats this answer, finds it in the pool. The keys of generated blocks continue the
prompt's chain (``kvxfer.store.extend_keys``) as they fill. A finished request whose puts may still read its blocks keeps them
(``request_finished`` answers ``True``) until the worker reports its puts ended.

Worker (:class:`PoolMover`, two KVStore clients over the engine's registered pool, one
for loads and one for puts, so a load never queues behind a backlog of puts):
loads post ``store.get`` before the forward and end in ``finished_recving``
(``failed_recving`` on any failure: vLLM recomputes or fails the request per
``kv_load_failure_policy``); puts post ``store.put`` after the forward and never
wait: at most ``store_put_blocks`` blocks are in flight, the rest are dropped and
counted. A preempted request's in-flight puts are waited for (bounded) before the
step that could reuse its blocks.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

log = logging.getLogger("vllm.kvxfer")

PREEMPT_WAIT_S = 30.0  # longest a step waits for a preempted request's puts


@dataclass(frozen=True)
class PoolBlocks:
    """Worker: ``keys[i]`` <-> block ``block_ids[i]`` of ``request_id``: a load
    (``store.get``, before the step's forward) or a put (``store.put``, after it)."""

    request_id: str
    keys: tuple
    block_ids: tuple


def model_salt(vllm_config, extra: str = "") -> bytes:
    """The model identity the pool's keys carry: the model's name or path and revision,
    dtype and cache dtype, layer, kv-head and head-size counts, block size, the CPU
    attention kernel path (its K layout) and ``extra`` (e.g. a weights digest). The same
    on every host and process; no per-process hash seed."""
    from .layout import attention_path

    m, p = vllm_config.model_config, vllm_config.parallel_config
    block = vllm_config.cache_config.block_size
    head = m.get_head_size()
    parts = [m.model, m.revision or "", str(m.dtype), str(vllm_config.cache_config.cache_dtype),
             f"L{m.get_num_layers(p)}", f"H{m.get_total_num_kv_heads()}", f"D{head}", f"B{block}",
             attention_path(vllm_config, block, head), extra]
    return "|".join(parts).encode()


def open_store(config, *, staging_bytes: int = 64 << 20):
    """A :class:`kvxfer.KVStore` on ``config.store`` (an etcd URL or node addresses)."""
    from ...store import KVStore

    where = {"discovery": config.store} if isinstance(config.store, str) else {"nodes": list(config.store)}
    return KVStore(**where, secret=config.secret, timeout=config.store_timeout, staging_bytes=staging_bytes)


@dataclass
class _Track:
    request: object
    keys: list
    put_upto: int  # blocks below this are local hits, pool hits or queued for put already
    puts_sent: bool = False


class PoolPlanner:
    """Scheduler side: lookups, load plans, put plans."""

    def __init__(self, config, vllm_config, block_size: int) -> None:
        self.block_size = block_size
        self.salt = model_salt(vllm_config, config.store_salt)
        self.store = open_store(config, staging_bytes=1 << 12)  # lookups only: nothing is staged
        self._tracked: dict = {}  # request id -> _Track
        self._matched: dict = {}  # request id -> (local blocks, pool blocks), until allocated
        self._loads: list = []
        self._puts: list = []
        self._holds: list = []
        self.holding: set = set()  # finished requests whose blocks wait for their puts
        self.stats = {"store_lookups": 0, "store_hit_tokens": 0, "store_local_hit_tokens": 0,
                      "store_queried_tokens": 0}

    def match(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own prefix hits) the pool holds."""
        from ...errors import KVXferError
        from ...store import block_keys

        prompt = request.prompt_token_ids
        track = self._tracked.get(request.request_id)
        if track is None or track.request is not request:
            track = _Track(request, block_keys(prompt, self.block_size, salt=self.salt), 0)
            self._tracked[request.request_id] = track
        local = num_computed_tokens // self.block_size
        usable = (len(prompt) - 1) // self.block_size  # vLLM computes at least the last token
        hits = 0
        if local < usable:
            self.stats["store_lookups"] += 1
            try:
                hits = self.store.lookup(track.keys[local:usable])
            except KVXferError as exc:  # a wrong secret: every lookup would fail the same way
                log.warning("kvxfer: pool lookup failed: %s", exc)
        track.put_upto = local + hits
        self._matched[request.request_id] = (local, hits)
        return hits * self.block_size

    def allocated(self, request, block_ids, num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (group 0, token order) for ``request``."""
        local, hits = self._matched.pop(request.request_id, (None, 0))
        track = self._tracked.get(request.request_id)
        if local is None or track is None:
            return
        n = min(hits, max(0, num_external_tokens) // self.block_size)
        track.put_upto = local + n
        self.stats["store_local_hit_tokens"] += local * self.block_size
        self.stats["store_queried_tokens"] += len(request.prompt_token_ids)
        if n > 0:
            self.stats["store_hit_tokens"] += n * self.block_size
            self._loads.append(PoolBlocks(request.request_id, tuple(track.keys[local:local + n]),
                                        tuple(block_ids[local:local + n])))

    def plan_puts(self, num_scheduled_tokens: dict, block_ids_of) -> None:
        """Queue puts of the blocks this step fills, prompt or generated tokens
        (``num_scheduled_tokens``: request id -> tokens computed this step;
        ``block_ids_of(request id)``: its blocks)."""
        from ...store import extend_keys

        for req_id, n in num_scheduled_tokens.items():
            track = self._tracked.get(req_id)
            if track is None or n <= 0:
                continue
            tokens = track.request.all_token_ids  # prompt, then the tokens generated so far
            full = min(track.request.num_computed_tokens + n, len(tokens)) // self.block_size
            if full > len(track.keys):  # generated tokens filled a block: its key continues the chain
                track.keys = extend_keys(track.keys, tokens[:full * self.block_size], self.block_size,
                                         salt=self.salt)
            if full > track.put_upto:
                ids = block_ids_of(req_id)
                self._puts.append(PoolBlocks(req_id, tuple(track.keys[track.put_upto:full]),
                                          tuple(ids[track.put_upto:full])))
                track.put_upto, track.puts_sent = full, True

    def take(self) -> tuple:
        """``(loads, puts, holds)`` for this step's metadata."""
        out = (self._loads, self._puts, self._holds)
        self._loads, self._puts, self._holds = [], [], []
        return out

    def finished(self, request, *, held_for_send: bool) -> bool:
        """The request finished: True if its blocks must wait for its puts (the worker
        reports it in ``finished_sending``; with ``held_for_send`` the send's end does)."""
        self._matched.pop(request.request_id, None)
        track = self._tracked.pop(request.request_id, None)
        if track is None or not track.puts_sent:
            return False
        self.holding.add(request.request_id)
        if not held_for_send:
            self._holds.append(request.request_id)
        return True

    def close(self) -> None:
        self.store.close()


class PoolMover:
    """Worker side: gets into and puts from the engine's registered pool."""

    def __init__(self, config, wake: threading.Event) -> None:
        self.config = config
        self._wake = wake
        self.store = None  # loads
        self.put_store = None  # puts: a client of its own (each client runs one operation at a time)
        self.layout = None
        self._ended: queue.SimpleQueue = queue.SimpleQueue()  # ("load" | "put", request id, handle, blocks)
        self._loads: dict = {}  # request id -> handle
        self._failed: set = set()  # loads that failed before a get was posted
        self._puts: dict = {}  # request id -> [pending put handles]
        self._release: set = set()  # requests whose blocks wait for their puts
        self._blocks_in_flight = 0
        self.stats = {"store_loads": 0, "store_load_blocks": 0, "store_load_disk_blocks": 0, "store_load_failed": 0,
                      "store_put_blocks": 0, "store_put_failed": 0, "store_put_drops": 0, "store_bytes": 0}

    def open(self, layout) -> None:
        self.layout = layout
        self.store = open_store(self.config)
        self.put_store = open_store(self.config)

    @property
    def busy(self) -> bool:
        return bool(self._loads or self._puts)

    def has_news(self) -> bool:
        """A load or put ended since the last :meth:`results`."""
        return not self._ended.empty()

    def _watch(self, kind: str, req_id: str, handle, blocks: int) -> None:
        def ended(h) -> None:
            self._ended.put((kind, req_id, h, blocks))
            self._wake.set()

        handle.add_done_callback(ended)

    def post_loads(self, specs) -> None:
        from ...errors import KVXferError

        for spec in specs:
            try:
                handle = self.store.get(list(spec.keys), self.layout, list(spec.block_ids))
            except (KVXferError, ValueError) as exc:
                log.warning("kvxfer: cannot load %s from the pool: %s", spec.request_id, exc)
                self._failed.add(spec.request_id)
                continue
            self._loads[spec.request_id] = handle
            self._watch("load", spec.request_id, handle, len(spec.keys))

    def post_puts(self, specs) -> None:
        from ...errors import KVXferError

        for spec in specs:
            n = len(spec.keys)
            if self._blocks_in_flight + n > self.config.store_put_blocks:
                self.stats["store_put_drops"] += n
                continue
            try:
                handle = self.put_store.put(list(spec.keys), self.layout, list(spec.block_ids))
            except (KVXferError, ValueError) as exc:  # LimitExceeded: the client's queue is full
                log.warning("kvxfer: put of %d blocks of %s dropped: %s", n, spec.request_id, exc)
                self.stats["store_put_drops"] += n
                continue
            self._blocks_in_flight += n
            self._puts.setdefault(spec.request_id, []).append(handle)
            self._watch("put", spec.request_id, handle, n)

    def hold(self, req_ids) -> None:
        """The scheduler keeps these finished requests' blocks until their puts end."""
        self._release.update(req_ids)

    def has_puts(self, req_id: str) -> bool:
        return bool(self._puts.get(req_id))

    def wait_puts(self, req_ids) -> None:
        """Block until the puts reading ``req_ids``' blocks ended (preempted requests,
        whose blocks vLLM may hand to another request in this very step)."""
        for req_id in req_ids:
            for handle in list(self._puts.get(req_id, ())):
                try:
                    handle.wait(PREEMPT_WAIT_S)
                except Exception as exc:  # noqa: BLE001 - a failed put is counted when drained
                    log.warning("kvxfer: put of preempted %s: %r", req_id, exc)

    def results(self) -> tuple:
        """``(released, loaded, failed)`` request ids since the last call: ``released``
        finished requests whose puts all ended; ``loaded`` loads that ended (done or not);
        ``failed`` those that did not end done."""
        loaded, failed = set(self._failed), set(self._failed)
        self.stats["store_load_failed"] += len(self._failed)
        self._failed.clear()
        while True:
            try:
                kind, req_id, handle, blocks = self._ended.get_nowait()
            except queue.Empty:
                break
            ok = handle.state == "done"
            if ok:
                self.stats["store_bytes"] += handle.nbytes
            if kind == "load":
                self._loads.pop(req_id, None)
                loaded.add(req_id)
                if ok:
                    self.stats["store_loads"] += 1
                    self.stats["store_load_blocks"] += blocks
                    self.stats["store_load_disk_blocks"] += getattr(handle.result, "from_disk", 0)
                else:
                    log.warning("kvxfer: pool load of %s failed: %r", req_id, handle.error)
                    self.stats["store_load_failed"] += 1
                    failed.add(req_id)
                continue
            self._blocks_in_flight -= blocks
            self.stats["store_put_blocks" if ok else "store_put_failed"] += blocks
            pending = self._puts.get(req_id, [])
            if handle in pending:
                pending.remove(handle)
            if not pending:
                self._puts.pop(req_id, None)
        released = {r for r in self._release if not self._puts.get(r)}
        self._release -= released
        return released, loaded, failed

    def close(self) -> None:
        for store in (self.store, self.put_store):
            if store is not None:
                store.close()
