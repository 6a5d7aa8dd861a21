"""A prefill worker's use of the KV pool (``kvxfer serve --store``, ``kvxfer worker --store``).

:meth:`PrefillPool.submit` queues a new prompt; :meth:`PrefillPool.admit_queued` (the
worker's every tick, and each submit) admits the queue's head while the scheduler would
take it (nothing waiting before it, a batch slot and the blocks free), so every prompt
is looked up when it is admitted, also behind a queue. Admitting allocates the prompt's
blocks (this worker's own prefix-cache hits first), looks the prompt's next full blocks
up in the pool (``kvxfer.block_keys``
salted with the model identity), loads the leading hits straight into the allocated
blocks and counts them computed, so the scheduler prefills only the rest. The get is
waited for (a copy at memory speed, bounded by the store's ``timeout``); if it fails,
the blocks it did load (``.loaded``) count and the rest is computed. After the prefill,
:meth:`PrefillPool.put` posts a put of the full prompt blocks this worker computed and
never waits: at most ``max_put_blocks`` blocks are in flight; past that a put takes the
leading blocks that fit and drops the rest (counted), so a prompt longer than the budget
still pools its prefix. A sequence whose blocks a put still reads is released only once the put
ended (:meth:`release`, :meth:`poll`).
"""
from __future__ import annotations

import collections
import logging

log = logging.getLogger("kvxfer.worker")

GET_TIMEOUT_S = 30.0  # beyond the store's own per-request timeout: a last bound


def model_salt(model_name: str, matmul_dtype: str, layout) -> bytes:
    """The reference engine's model identity (:func:`kvxfer.serving.channel.ipc.pool_salt`):
    its name, projection dtype and the KV layout's fingerprint (layers, heads, head dim,
    dtype, block size), as its ready message reports them to the router."""
    from ..channel.ipc import pool_salt

    return pool_salt(model_name, matmul_dtype, layout.fingerprint())


class PrefillPool:
    def __init__(self, store, runtime, salt: bytes, *, max_put_blocks: int = 1024) -> None:
        self.store = store
        self.runtime = runtime
        # one object: the store registers it once. The virtual clock's runtime has no pool
        # (None): its store (kvxfer.sim.store) moves no bytes and reads no layout.
        self.layout = runtime.cache.kv_layout() if runtime.cache is not None else None
        self.salt = salt
        self.max_put_blocks = max_put_blocks
        # reported with the worker's counters (the router's kvxfer_worker_stat{stat=...})
        self.counters = dict.fromkeys(("store_lookups", "store_hit_tokens", "store_disk_hit_tokens",
                                       "store_local_hit_tokens", "store_load_failed", "store_put_blocks",
                                       "store_put_failed", "store_put_drops"), 0)
        self._keys: dict = {}  # request id -> (keys, first block this worker computed)
        self._puts: dict = {}  # request id -> (handle, blocks)
        self._deferred: dict = {}  # request id -> sequence to release once its put ended
        self.queue: collections.deque = collections.deque()  # submitted, not admitted yet

    def submit(self, seq) -> None:
        """A new prompt: admitted now if the scheduler would take it, else queued, in
        arrival order, for :meth:`admit_queued`."""
        self.queue.append(seq)
        self.admit_queued()

    def admit_queued(self) -> int:
        """Admit queued prompts from the head while :meth:`admit` takes them; how many."""
        n = 0
        while self.queue and self.admit(self.queue[0]):
            self.queue.popleft()
            n += 1
        return n

    def admit(self, seq) -> bool:
        """Allocate ``seq``, load its pool hits and hand it to the scheduler as allocated;
        False (nothing done) if the scheduler should admit it later (blocks or batch full)."""
        from ...errors import KVXferError
        from ...store import block_keys
        from ..engine.sequence import SequenceStatus

        sched, blocks = self.runtime.scheduler, self.runtime.blocks
        if sched.waiting or len(sched.running) >= sched.config.max_num_seqs or not blocks.can_allocate(seq):
            return False
        blocks.allocate(seq)
        size = self.runtime.block_size
        keys = block_keys(seq.token_ids, size, salt=self.salt)
        local = seq.num_computed_tokens // size
        usable = (seq.num_tokens - 1) // size  # the last token is always computed
        loaded = 0
        if local < usable:
            self.counters["store_lookups"] += 1
            hits = self.store.lookup(keys[local:usable])
            if hits:
                handle = None
                try:
                    handle = self.store.get(keys[local:local + hits], self.layout, seq.block_table[local:local + hits])
                    handle.wait(GET_TIMEOUT_S)
                    loaded = hits
                except KVXferError as exc:
                    loaded = int(getattr(exc, "loaded", 0) or 0)
                    self.counters["store_load_failed"] += 1
                    log.warning("%s: pool load failed after %d of %d blocks: %s", seq.request_id, loaded,
                                hits, exc)
                if handle is not None:  # the blocks the nodes read back from their disk tier
                    disk = getattr(handle.result, "from_disk", 0) or 0
                    self.counters["store_disk_hit_tokens"] += min(disk, loaded) * size
        self.counters["store_local_hit_tokens"] += local * size
        self.counters["store_hit_tokens"] += loaded * size
        seq.num_computed_tokens = (local + loaded) * size
        self._keys[seq.request_id] = (keys, local + loaded)
        seq.status = SequenceStatus.PREFILLING
        sched.add_allocated(seq)
        return True

    def put(self, seq) -> None:
        """``seq`` finished its prefill: put the full prompt blocks it computed (async)."""
        from ...errors import KVXferError

        keys, first = self._keys.pop(seq.request_id, ((), 0))
        n = len(keys) - first
        if n <= 0:
            return
        room = self.max_put_blocks - sum(b for _, b in self._puts.values())
        if n > room:  # the leading blocks that fit: keys are chained, a prefix is useful alone
            self.counters["store_put_drops"] += n - max(room, 0)
            n = room
            if n <= 0:
                return
        try:
            handle = self.store.put(keys[first:first + n], self.layout, seq.block_table[first:first + n])
        except KVXferError as exc:  # LimitExceeded: the client's queue is full
            self.counters["store_put_drops"] += n
            log.warning("%s: put of %d blocks dropped: %s", seq.request_id, n, exc)
            return
        self._puts[seq.request_id] = (handle, n)

    def forget(self, seq) -> None:
        """``seq`` left before its prefill finished (aborted): nothing to put (queued: it
        leaves the queue)."""
        self._keys.pop(seq.request_id, None)
        if self.queue and seq in self.queue:
            self.queue.remove(seq)

    def release(self, seq) -> bool:
        """True if ``seq``'s blocks must wait for its put (then :meth:`poll` returns it)."""
        if seq.request_id in self._puts:
            self._deferred[seq.request_id] = seq
            return True
        return False

    @property
    def busy(self) -> bool:
        """Prompts queued or puts in flight."""
        return bool(self._puts or self.queue)

    def poll(self) -> list:
        """Account ended puts; the deferred sequences whose blocks may be released now."""
        free = []
        for rid, (handle, n) in list(self._puts.items()):
            if not handle.done():
                continue
            del self._puts[rid]
            self.counters["store_put_blocks" if handle.state == "done" else "store_put_failed"] += n
            seq = self._deferred.pop(rid, None)
            if seq is not None:
                free.append(seq)
        return free

    def close(self) -> None:
        self.store.close()
