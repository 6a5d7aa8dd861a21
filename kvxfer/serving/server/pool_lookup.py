"""The router's look into the KV pool (``kvxfer serve --store ... --routing kv``).

Before a request is routed, the router asks the pool how many leading full blocks of its
prompt it holds (``pool_hit_blocks``). The ``kv`` policy then counts only a prefill
worker's local hits past them as that worker's advantage (:mod:`.routing`): a block the
pool holds costs every prefill worker the same load, so the request need not queue on
the one worker that also caches it (as Mooncake's Conductor weighs its store).

The keys are the prefill workers' own: :func:`kvxfer.store.block_keys` of the prompt,
salted with the model identity a prefill worker's ``ready`` message names
(:func:`kvxfer.serving.channel.ipc.pool_salt`), so a lookup finds what that worker's
admission will load. A lookup runs on one thread, off the event loop, bounded by the
store client's ``timeout`` per node; at most ``MAX_WAITING`` wait for it. One that cannot
be made (no prefill worker reported yet, the queue full, the pool unreachable) counts
0 blocks: the request is routed on local hits alone, as without a pool.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from ..channel.ipc import pool_salt

log = logging.getLogger("kvxfer.serve")

MAX_WAITING = 64  # lookups queued for the thread; past it a request is routed without one
LOOKUP_TIMEOUT_S = 2.0  # the router's store client's per-node timeout
STAGING_BYTES = 1 << 12  # the client never moves blocks: a token staging buffer


def lookup_keys(prompt_ids, block_size: int, salt: bytes) -> list[bytes]:
    """The pool keys the router looks ``prompt_ids`` up with: those of its full blocks
    before the last token (which a worker's admission always computes)."""
    from ...store import block_keys

    usable = (len(prompt_ids) - 1) // block_size if prompt_ids else 0
    return block_keys(prompt_ids[:usable * block_size], block_size, salt=salt) if usable > 0 else []


class PoolLookup:
    """``hits(prompt_ids, info)``: leading full blocks of ``prompt_ids`` in the pool.

    ``store``: a :class:`kvxfer.KVStore` (or anything with its ``lookup``); ``block_size``:
    tokens a block, the workers'."""

    def __init__(self, store, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pool-lookup")
        self.waiting = 0
        self.counters = dict.fromkeys(("lookups", "hit_blocks", "skipped", "failed"), 0)

    @classmethod
    def open(cls, config, block_size: int) -> "PoolLookup | None":
        """The router's lookup for ``config`` (a :class:`ServeConfig`): None unless it has a
        pool, disaggregated workers and the ``kv`` policy (the only one that reads it)."""
        if config.store is None or not config.is_disaggregated or config.routing != "kv":
            return None
        from ... import KVStore
        from ...secrets import load_secret

        where = ({"discovery": config.store} if config.store.startswith("etcd://")
                 else {"nodes": [a.strip() for a in config.store.split(",") if a.strip()]})
        # the workers read the same secret after the router: it stays in the environment
        store = KVStore(**where, secret=load_secret(config.secret_file), timeout=LOOKUP_TIMEOUT_S,
                        staging_bytes=STAGING_BYTES)
        return cls(store, block_size)

    def salt(self, info: dict | None) -> bytes | None:
        """The salt of the model a worker's ready message ``info`` names, None if it lacks one."""
        if not info or not all(isinstance(info.get(k), str) for k in ("model", "matmul", "kv_fingerprint")):
            return None
        return pool_salt(info["model"], info["matmul"], info["kv_fingerprint"])

    async def hits(self, prompt_ids: list[int], info: dict | None) -> int:
        """Leading full blocks of ``prompt_ids`` (the last token never counts, as a worker's
        admission) in the pool, for the model of prefill worker ``info``; 0 when no lookup
        could be made (module docstring)."""
        from ...errors import KVXferError

        salt = self.salt(info)
        keys = lookup_keys(prompt_ids, self.block_size, salt) if salt is not None else []
        if not keys:
            return 0
        if self.waiting >= MAX_WAITING:
            self.counters["skipped"] += 1
            return 0
        self.waiting += 1
        try:
            n = await asyncio.get_running_loop().run_in_executor(self._thread, self.store.lookup, keys)
        except (KVXferError, OSError) as exc:
            self.counters["failed"] += 1
            log.warning("pool lookup failed, routing on local hits: %s", exc)
            return 0
        finally:
            self.waiting -= 1
        self.counters["lookups"] += 1
        self.counters["hit_blocks"] += n
        return n

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.store.close()
