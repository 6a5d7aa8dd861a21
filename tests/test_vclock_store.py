"""The KV pool on the virtual clock (``kvxfer simulate --store``): the prefill workers' own
:class:`~kvxfer.serving.workers.pool.PrefillPool` over :mod:`kvxfer.sim.store` (the store
nodes' real index and placement), and that class's admission and put rules."""
from __future__ import annotations

import heapq
import itertools

import pytest

from kvxfer.serving.engine.config import EngineConfig
from kvxfer.serving.engine.sampling import SamplingParams
from kvxfer.serving.engine.sequence import Sequence
from kvxfer.serving.workers.pool import PrefillPool
from kvxfer.sim.configs import parse_config
from kvxfer.serving.simulated.link import Link, NicQueue
from kvxfer.sim.store import StoreSpec, VirtualStore, VirtualStoreClient
from kvxfer.sim.vclock import VirtualCluster, simulate
from kvxfer.sim.virtual_worker import VirtualRuntime
from kvxfer.store import block_keys

from test_vclock import LINK, _profile

BLOCK = 16
SALT = b"test"


class _Clock:
    """A bare event queue for one or two workers' pools, outside a cluster."""

    def __init__(self) -> None:
        self.now, self.events, self.order = 0.0, [], itertools.count()

    def at(self, t, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.order), fn, args))

    def run(self) -> None:
        while self.events:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)


def _worker(clock, store, *, num_blocks=64, max_num_seqs=8, max_put_blocks=1024):
    runtime = VirtualRuntime(EngineConfig(num_blocks=num_blocks, block_size=BLOCK,
                                          max_num_seqs=max_num_seqs), _profile())
    puts_done = []
    client = VirtualStoreClient(store, NicQueue(LINK), lambda: 0.0, clock.at, lambda: puts_done.append(1))
    return runtime, PrefillPool(client, runtime, SALT, max_put_blocks=max_put_blocks), puts_done


def _seq(rid, ids):
    return Sequence(list(ids), SamplingParams(max_tokens=4, ignore_eos=True), rid)


def _prefill(runtime, seq):
    """Step ``runtime`` until ``seq`` has its first token; it leaves the batch (as on a
    prefill worker, which keeps its blocks until its send and put ended)."""
    while True:
        step = runtime.step()
        if any(s is seq for s, _ in step.produced):
            runtime.scheduler.running.remove(seq)
            return


def test_a_prompt_another_worker_put_loads_from_the_pool_and_costs_its_transfer():
    clock = _Clock()
    store = VirtualStore(StoreSpec(2, 100), _profile(), lambda: clock.now)
    prompt = list(range(500, 500 + 5 * BLOCK + 3))  # 5 full blocks and a tail
    a, pool_a, done_a = _worker(clock, store)
    seq = _seq("r0", prompt)
    pool_a.submit(seq)
    assert pool_a.counters["store_lookups"] == 1 and pool_a.counters["store_hit_tokens"] == 0
    _prefill(a, seq)
    pool_a.put(seq)
    assert pool_a.release(seq)  # its blocks wait for the put
    keys = block_keys(prompt, BLOCK, salt=SALT)
    assert pool_a.store.lookup(keys) == 0  # readable only once the put committed
    clock.run()  # the put commits at its modelled end
    assert done_a and [s.request_id for s in pool_a.poll()] == ["r0"]
    assert pool_a.counters["store_put_blocks"] == 5 and store.stats()["objects"] == 5

    b, pool_b, _ = _worker(clock, store)
    clock.now = 10.0
    again = _seq("r1", prompt)
    pool_b.submit(again)
    assert pool_b.counters["store_hit_tokens"] == 5 * BLOCK  # every full block but none past
    assert again.num_computed_tokens == 5 * BLOCK and again in b.scheduler.running
    # the worker waits for the get: 5 real blocks over its ingress (nodes in parallel)
    assert pool_b.store.ready_at == pytest.approx(10.0 + LINK.seconds(5 * BLOCK * 1024))


def test_a_prompt_queued_behind_others_is_still_looked_up_when_admitted():
    clock = _Clock()
    store = VirtualStore(StoreSpec(1, 100), _profile(), lambda: clock.now)
    pooled = list(range(900, 900 + 4 * BLOCK + 1))
    first, pool_first, _ = _worker(clock, store)
    seq = _seq("p", pooled)
    pool_first.submit(seq)
    _prefill(first, seq)
    pool_first.put(seq)
    clock.run()
    assert store.stats()["objects"] == 4

    runtime, pool, _ = _worker(clock, store, max_num_seqs=1)
    busy = _seq("busy", range(7000, 7000 + 2 * BLOCK))
    pool.submit(busy)  # takes the one batch slot
    waiting = _seq("w", pooled)
    pool.submit(waiting)
    assert list(pool.queue) == [waiting] and pool.counters["store_lookups"] == 1  # not yet
    assert pool.busy
    _prefill(runtime, busy)  # the slot frees
    assert pool.admit_queued() == 1 and not pool.queue
    assert pool.counters["store_hit_tokens"] == 4 * BLOCK and waiting.num_computed_tokens == 4 * BLOCK


def test_a_put_longer_than_the_budget_pools_its_leading_blocks():
    clock = _Clock()
    store = VirtualStore(StoreSpec(1, 100), _profile(), lambda: clock.now)
    runtime, pool, _ = _worker(clock, store, max_put_blocks=3)
    prompt = list(range(300, 300 + 5 * BLOCK + 2))
    seq = _seq("long", prompt)
    pool.submit(seq)
    _prefill(runtime, seq)
    pool.put(seq)
    assert pool.counters["store_put_drops"] == 2
    clock.run()
    pool.poll()
    assert pool.counters["store_put_blocks"] == 3
    assert pool.store.lookup(block_keys(prompt, BLOCK, salt=SALT)) == 3  # the chain's head
    # nothing in flight is left for an aborted one: forget leaves the queue and keys clean
    other = _seq("gone", range(40, 40 + BLOCK + 1))
    pool.queue.append(other)
    pool.forget(other)
    assert not pool.queue and "gone" not in pool._keys


def test_a_full_node_evicts_its_least_recent_objects():
    clock = _Clock()
    store = VirtualStore(StoreSpec(1, 8), _profile(), lambda: clock.now)
    runtime, pool, _ = _worker(clock, store)
    for k in range(3):  # 4 blocks each: 12 objects through 8 slots
        seq = _seq(f"r{k}", range(1000 * (k + 1), 1000 * (k + 1) + 4 * BLOCK + 1))
        pool.submit(seq)
        _prefill(runtime, seq)
        pool.put(seq)
        clock.run()
        pool.poll()
        runtime.release(seq, "stop")
    stats = store.stats()
    assert stats["objects"] <= 8 and stats["evictions"] >= 4
    newest = block_keys(range(3000, 3000 + 4 * BLOCK + 1), BLOCK, salt=SALT)
    assert pool.store.lookup(newest) == 4


def _twice(prompt_a, prompt_b, gap_s=5.0):
    """A and B at once (one a prefill worker, least-loaded), then B again when all is idle:
    least-loaded sends it to the first worker, which never computed B."""
    return [(0.0, prompt_a, 4), (0.0, prompt_b, 4), (gap_s, prompt_b, 4)]


def test_the_cluster_serves_a_repeat_from_the_pool_and_frees_everything():
    prompt_a = list(range(100, 100 + 12 * BLOCK + 5))
    prompt_b = list(range(5000, 5000 + 12 * BLOCK + 5))
    config = parse_config("2P1D", num_blocks=128)
    off = simulate(config, _profile(), _twice(prompt_a, prompt_b))
    cluster = VirtualCluster(config, _profile(), store=StoreSpec(2, 256))
    on = cluster.run(_twice(prompt_a, prompt_b))
    for w in cluster.workers:  # every block back, no put or queued prompt left
        assert w.runtime.blocks.num_free_blocks == 128 and not w.seqs and not w.inflight
        assert not w.pool.busy and not w.pool._deferred and not w.pool._keys
    for res in (off, on):
        assert all(r["ok"] for r in res.records) and len(res.records) == 3
    repeat_off, repeat_on = (max(res.records, key=lambda r: r["sent_s"]) for res in (off, on))
    assert repeat_on["prefill"] == repeat_off["prefill"] == "prefill-0"
    c = on.counters
    assert c["store_lookups"] == 3 and c["store_hit_tokens"] == 12 * BLOCK
    assert c["store_put_blocks"] == 24 and c["store_node_objects"] == 24  # B's blocks put once
    assert repeat_on["ttft_s"] < repeat_off["ttft_s"]  # 12 of 13 blocks loaded, not computed
    assert "store_lookups" not in off.counters


def test_colocated_workers_have_no_pool_and_bad_specs_are_refused():
    prompt = list(range(64))
    res = simulate(parse_config("colocated:2"), _profile(), [(0.0, prompt, 2)], store=StoreSpec(1, 8))
    assert res.counters["store_node_objects"] == 0 and "store_lookups" not in res.counters
    for bad in ("2", "x8", "0x8", "2x0", "2x-1", "ax8"):
        with pytest.raises(ValueError):
            StoreSpec.parse(bad)
    assert StoreSpec.parse("2X125000") == StoreSpec(2, 125000)
    with pytest.raises(ValueError):
        StoreSpec(1, True)
    with pytest.raises(ValueError):
        VirtualStoreClient(VirtualStore(StoreSpec(1, 4), _profile(), lambda: 0.0),
                           NicQueue(Link(1.0, 0.0)), lambda: 0.0, None, None).get([b"k"], None, [])


def test_kv_routing_weighs_the_pools_blocks_as_the_router_does():
    x = list(range(100, 100 + 12 * BLOCK + 5))  # 12 full blocks, cached on prefill-0 and pooled
    z = list(range(9000, 9000 + 3 * BLOCK))  # a short prompt that keeps prefill-0 busy
    arrivals = [(0.0, x, 4), (5.0, z, 4), (5.0001, x, 4)]
    config = parse_config("2P1D", num_blocks=128)
    picks = {}
    for name, kw in (("kv", {}), ("kv+store", {"store": StoreSpec(1, 256)}),
                     ("least-loaded+store", {"store": StoreSpec(1, 256), "routing": "least-loaded"})):
        res = simulate(config, _profile(), arrivals, **{"routing": "kv", **kw})
        picks[name] = [r["prefill"] for r in sorted(res.records, key=lambda r: r["sent_s"])]
        picks[name + " pool blocks"] = res.counters.get("routed_pool_blocks")
    # local hits only: prefill-0's 12 cached blocks outweigh its 3 pending ones
    assert picks["kv"] == ["prefill-0", "prefill-0", "prefill-0"]
    # the pool holds all 12: they are no advantage, and prefill-1 is idle (it loads them)
    assert picks["kv+store"] == ["prefill-0", "prefill-0", "prefill-1"]
    assert picks["kv+store pool blocks"] == 12
    assert picks["least-loaded+store pool blocks"] is None  # its pick reads no pool
