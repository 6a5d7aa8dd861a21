"""Routing policies and the router's prefix index (kvxfer.serving.server.routing)."""
import subprocess
import sys

import pytest

from kvxfer.serving.engine.block_manager import BlockManager, block_hash
from kvxfer.serving.engine.sequence import Sequence
from kvxfer.serving.server.routing import (MAX_EVENT_HASHES, Booking, KVRouting,
                                           LeastLoadedRouting, PrefixIndex, make_policy,
                                           prefix_hashes)

B = 4


class W:
    """A worker-like candidate: a name and a load."""

    def __init__(self, name, load=0):
        self.name, self.load = name, load

    def __repr__(self):
        return f"W({self.name}, {self.load})"


def chain(tokens, block_size=B):
    return list(prefix_hashes(tokens, block_size))


def cached_on(bm, tokens):
    """Run ``tokens`` through ``bm`` as a prefill would: allocate, compute, cache."""
    s = Sequence(list(tokens))
    bm.allocate(s)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return s


def test_prefix_hashes_equal_the_block_managers():
    bm = BlockManager(16, B)
    bm.record_events()
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    cached_on(bm, tokens)
    stored, removed = bm.drain_events()
    assert removed == [] and stored == chain(tokens + [0])  # every full block, in order
    assert chain(tokens) == chain(tokens + [0])[:3]
    assert bm.match_prefix(tokens + [7])[1] == chain(tokens + [7])
    assert chain(tokens)[0] == block_hash(tokens[:4], None)
    # the router hashes in another process and gets the same chain
    code = ("from kvxfer.serving.server.routing import prefix_hashes; import sys;"
            f"print(list(prefix_hashes({tokens!r}, {B})));"
            "print(sorted(m for m in ('torch', 'fastapi', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == [str(chain(tokens)), "[]"]  # and the module needs no heavy import


def test_block_manager_events_follow_its_cache():
    bm = BlockManager(4, B)
    assert bm.drain_events() == ([], [])  # not recording: nothing kept
    bm.record_events()
    a = cached_on(bm, range(9))  # 2 full blocks hashed (the third holds the last token)
    stored, removed = bm.drain_events()
    assert stored == chain(range(9)) and removed == []
    assert bm.drain_events() == ([], [])
    bm.deallocate(a)
    assert bm.drain_events() == ([], [])  # freed blocks keep their hash
    cached_on(bm, range(50, 66))  # 4 fresh blocks: both cached hashes leave
    stored, removed = bm.drain_events()
    assert sorted(removed) == sorted(chain(range(9)))
    assert stored == chain(list(range(50, 66)) + [0])  # all 4 computed blocks
    # the router's index fed these events holds what the cache holds
    idx = PrefixIndex()
    idx.apply("w", chain(range(9)), [])
    idx.apply("w", stored, removed)
    assert set(bm._hash_to_block) == {h for h in chain(range(9)) + stored if idx.holds("w", h)}
    assert idx.num_blocks("w") == 4


def test_index_longest_prefix_per_worker():
    idx = PrefixIndex()
    p = list(range(40))  # 9 full blocks counted ((40 - 1) // 4)
    h = chain(p)
    idx.apply("a", h[:5], [])
    idx.apply("b", h[:2] + h[3:8], [])  # a hole at block 2: only 2 count
    idx.apply("c", h[1:], [])  # lacks the first block: nothing counts
    assert idx.hits(p, B, ["a", "b", "c", "d"]) == {"a": 5, "b": 2, "c": 0, "d": 0}
    assert idx.hits(p[:9], B, ["a"]) == {"a": 2}
    assert idx.hits([], B, ["a"]) == {"a": 0}
    idx.apply("a", [], [h[1]])
    assert idx.hits(p, B, ["a"]) == {"a": 1}
    assert len(idx) == 4 + 7 + 8


def test_index_bounds_and_forget():
    idx = PrefixIndex(max_blocks_per_worker=8, max_workers=2)
    h = chain(range(100))
    idx.apply("a", h[:10], [])
    assert idx.num_blocks("a") == 8 and not idx.holds("a", h[0]) and idx.holds("a", h[9])
    idx.set_capacity("a", 3)  # the worker's own num_blocks
    assert idx.num_blocks("a") == 3 and [x for x in h if idx.holds("a", x)] == h[7:10]
    idx.apply("a", [h[7]], [])  # stored again: the newest now
    idx.apply("a", [h[20]], [])
    assert [x for x in h if idx.holds("a", x)] == [h[7], h[9], h[20]]
    idx.apply("b", h[:2], [])
    with pytest.raises(ValueError, match="2 workers"):
        idx.apply("c", h[:1], [])
    idx.apply("c", [], h[:1])  # nothing to store: no slot taken, no error
    idx.forget("b")
    assert idx.num_blocks("b") == 0 and idx.hits(list(range(100)), B, ["b"]) == {"b": 0}
    idx.apply("c", h[:1], [])
    assert len(idx) == 4
    idx.forget("a")
    idx.forget("c")
    assert len(idx) == 0 and idx._holders == {}


def test_index_total_bound_evicts_only_the_storing_worker():
    idx = PrefixIndex(max_blocks_per_worker=8, max_workers=4, max_entries=10)
    h = chain(range(100))
    idx.apply("a", h[:6], [])
    idx.apply("b", h[10:18], [])  # 6 + 8 > 10: b keeps its newest 4
    assert idx.num_blocks("a") == 6 and len(idx) == 10
    assert [x for x in h if idx.holds("b", x)] == h[14:18]
    idx.apply("a", [], h[:3])
    idx.apply("b", h[18:20], [])  # room again
    assert idx.num_blocks("b") == 6 and len(idx) == 9


@pytest.mark.parametrize("stored, removed, error", [
    ("nope", [], TypeError),
    ([1, "2"], [], ValueError),
    ([True], [], ValueError),
    ([1 << 64], [], ValueError),
    ([-1], [], ValueError),
    ([1.0], [], ValueError),
    ([], {1: 2}, TypeError),
    (list(range(MAX_EVENT_HASHES)), [1], ValueError),
])
def test_hostile_events_fail_alone_and_leave_the_index(stored, removed, error):
    idx = PrefixIndex()
    h = chain(range(20))
    idx.apply("a", h, [])
    with pytest.raises(error):
        idx.apply("a", stored, removed)
    with pytest.raises(TypeError):
        idx.apply(7, h, [])
    assert len(idx) == len(h) and idx.hits(list(range(20)), B, ["a"]) == {"a": len(h)}


def test_least_loaded_is_todays_pick():
    p = make_policy("least-loaded", B)
    assert isinstance(p, LeastLoadedRouting)
    ws = [W("a", 2), W("b", 1), W("c", 1)]
    p.on_kv_event("a", chain(range(40)), [])
    assert p.pick(ws, list(range(40))) is ws[1]  # min load, first on a tie; hits ignored
    assert p.pick(ws) is ws[1] and p.pick([]) is None
    r = p.route(ws, list(range(40)))
    assert (r.worker, r.hit_blocks, r.prompt_blocks) == (ws[1], 0, 9)
    ws[1].load = 5
    assert p.route(ws[:1], list(range(40))).hit_blocks == 9  # a chance hit is counted
    assert p.stats == {"routed": 4, "hit_blocks": 9, "prompt_blocks": 27}


def test_kv_goes_to_the_longest_prefix():
    p = make_policy("kv", B)
    prompt = list(range(40))
    p.on_kv_event("b", chain(prompt)[:3], [])
    p.on_kv_event("c", chain(prompt)[:6], [])
    ws = [W("a", 0), W("b", 1), W("c", 2)]
    r = p.route(ws, prompt)
    assert (r.worker.name, r.hit_blocks, r.prompt_blocks) == ("c", 6, 9)
    # equal hits: the less loaded one, then the first
    p.on_kv_event("b", chain(prompt)[3:6], [])
    assert p.pick(ws, prompt).name == "b"
    ws[2].load = 1
    assert p.pick(ws, prompt).name == "b"
    # no hit, None or a prompt shorter than a block: least-loaded
    assert p.pick(ws, list(range(500, 540))).name == "a"
    assert p.pick(ws, None).name == "a" and p.pick(ws, [1, 2, 3, 4]).name == "a"
    assert p.pick([], prompt) is None


def test_kv_overloaded_holder_loses_the_request():
    p = make_policy("kv", B, load_gap=3)
    prompt = list(range(40))
    h = chain(prompt)
    p.on_kv_event("hot", h, [])
    p.on_kv_event("warm", h[:2], [])
    hot, warm, idle = W("hot", 3), W("warm", 0), W("idle", 0)
    ws = [idle, hot, warm]
    assert p.pick(ws, prompt) is hot  # load 3 <= 0 + gap
    hot.load = 4
    assert p.pick(ws, prompt) is warm  # overloaded: the next best eligible hit
    warm.load = 4
    assert p.pick(ws, prompt) is idle  # no eligible hit: least-loaded
    idle.load = 2
    assert p.pick(ws, prompt) is hot  # the gap is relative to the least load


def test_kv_min_hit_blocks_and_pool_hits():
    p = make_policy("kv", B, min_hit_blocks=3)
    prompt = list(range(40))
    p.on_kv_event("b", chain(prompt)[:2], [])
    ws = [W("a", 0), W("b", 1)]
    assert p.pick(ws, prompt).name == "a"  # 2 blocks are not worth leaving the idle worker
    p.on_kv_event("b", chain(prompt)[2:5], [])
    assert p.pick(ws, prompt).name == "b"
    # the pool holds 4 of them: only 1 local block is an advantage, below min_hit_blocks
    assert p.pick(ws, prompt, pool_hit_blocks=4).name == "a"


def test_kv_books_blocks_and_weighs_them_over_request_counts():
    p = make_policy("kv", B)  # overlap_weight 4: a block to prefill weighs 4 held
    a, b = W("a"), W("b")
    long_prompt = list(range(41))  # 10 full blocks, 11 with its last token
    r = p.route([a, b], long_prompt, request_id="r1", max_tokens=7)
    assert r.worker is a and p.booked("a") == Booking(10, 12)  # ceil((41 + 7) / 4) held
    a.load, b.load = 1, 2  # least-loaded would now pick a
    short = list(range(100, 109))  # 2 full blocks
    # a: 4 * (10 + 2) + 12 = 60, b: 4 * 2 = 8 blocks
    assert p.pick([a, b], short) is b and p.cost("a", 0, 2) == 60 and p.cost("b", 0, 2) == 8
    p.prefilled("r1")  # its prompt is computed: only its held blocks weigh
    assert p.booked("a") == Booking(0, 12) and p.cost("a", 0, 2) == 20
    p.release("r1")
    assert p.booked("a") == Booking(0, 0) and p.pick([a, b], short) is a  # equal: fewer requests
    p.release("r1")  # a second release (or an unknown id) changes nothing
    p.prefilled("nope")
    assert p.booked("a") == Booking(0, 0)


def test_kv_booking_per_worker_hits_and_decode_bookings():
    p = make_policy("kv", B)
    prompt = list(range(41))
    p.on_kv_event("d1", chain(prompt)[:6], [])
    d0, d1, p0 = W("d0"), W("d1"), W("p0")
    # a decode worker receives the prompt's KV: nothing to prefill, the hit spares the transfer
    assert p.route([d0, d1], prompt, request_id="r", max_tokens=3, prefills=False).worker is d1
    assert p.booked("d1") == Booking(0, 11)
    assert p.route([p0], prompt, request_id="r").worker is p0  # a prefill worker: no hit there
    assert p.booked("p0") == Booking(10, 11)
    p.route([p0], prompt, request_id="r", max_tokens=1)  # booked again: replaced, not added
    assert p.booked("p0") == Booking(10, 11)
    p.prefilled("r")
    p.release("r", "p0")  # its KV was sent: the prefill worker is done with it
    assert p.booked("p0") == Booking(0, 0) and p.booked("d1") == Booking(0, 11)
    p.forget("d1")  # a dead worker's bookings go with its index entries
    assert p.booked("d1") == Booking(0, 0)
    p.release("r")
    # a hit on a worker with much booked work loses to an idle worker
    p.on_kv_event("d1", chain(prompt)[:6], [])
    p.route([d1], list(range(200, 241)), request_id="busy")  # 10 blocks to prefill on d1
    assert p.pick([d0, d1], prompt) is d0  # d0: 4 * 10 = 40; d1: 4 * (10 + 10 - 6) + 11 = 67


def test_least_loaded_keeps_the_ledger_but_ignores_it():
    p = make_policy("least-loaded", B)
    a, b = W("a"), W("b", 1)
    assert p.route([a, b], list(range(41)), request_id="r", max_tokens=3).worker is a
    assert p.booked("a") == Booking(10, 11)
    assert p.pick([a, b], list(range(41))) is a  # fewest requests, whatever is booked
    p.release("r")
    assert p.booked("a") == Booking(0, 0)


def test_forget_drops_a_worker():
    p = make_policy("kv", B)
    prompt = list(range(40))
    p.on_kv_event("b", chain(prompt), [])
    ws = [W("a", 0), W("b", 1)]
    assert p.pick(ws, prompt).name == "b"
    p.forget("b")
    assert p.pick(ws, prompt).name == "a" and len(p.index) == 0


def test_make_policy_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", B)
    with pytest.raises(ValueError):
        make_policy("kv", 0)
    with pytest.raises(ValueError):
        make_policy("kv", B, load_gap=-1)
    with pytest.raises(ValueError):
        make_policy("kv", B, min_hit_blocks=0)
    for bad in (-1.0, float("inf"), float("nan"), "2"):
        with pytest.raises(ValueError):
            make_policy("kv", B, overlap_weight=bad)
    with pytest.raises(TypeError):
        make_policy("least-loaded", B, load_gap=2)
    with pytest.raises(TypeError):
        make_policy("least-loaded", B, overlap_weight=2.0)
    assert isinstance(make_policy("kv", B, max_workers=4), KVRouting)


class _Channel:
    def __init__(self):
        self.sent = []
        self.inbox = None

    def send(self, msg):
        self.sent.append(msg)


@pytest.fixture
def keep_signals():
    """WorkerLoop installs its process's SIGTERM/SIGINT handlers: give pytest its own back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_worker_loop_publishes_cache_events_bounded_and_answers_snapshots(keep_signals):
    from types import SimpleNamespace

    from kvxfer.serving.workers.loop import WorkerContext, WorkerLoop

    bm = BlockManager(3 * MAX_EVENT_HASHES, B)
    runtime = SimpleNamespace(blocks=bm, step=lambda: "step")
    chan = _Channel()
    loop = WorkerLoop(WorkerContext("w", "colocated", chan, runtime, None, 1.0, "fail"))
    assert loop.step() == "step" and chan.sent == []  # nothing changed: nothing sent
    tokens = list(range(B * (MAX_EVENT_HASHES + 10)))
    cached_on(bm, tokens)  # MAX_EVENT_HASHES + 10 hashes
    loop.step()
    assert [len(m["stored"]) + len(m["removed"]) for m in chan.sent] == [MAX_EVENT_HASHES, 10]
    assert all(m["ev"] == "kv_events" for m in chan.sent)
    stored = [h for m in chan.sent for h in m["stored"]]
    assert stored == chain(tokens + [0])
    policy = make_policy("kv", B)  # what the router builds from them
    for m in chan.sent:
        policy.on_kv_event("w", m["stored"], m["removed"])
    assert policy.route([W("v"), W("w", 3)], tokens + [0]).hit_blocks == len(stored)
    chan.sent.clear()
    assert loop._handle({"op": "kv_snapshot"})
    assert sorted(h for m in chan.sent for h in m["stored"]) == sorted(stored)
    assert loop._all_stats()["prefix_query_tokens"] == len(tokens)


# ---- real workers -------------------------------------------------------------------

PREFIX = list(range(1000, 1064))  # 64 tokens: 4 full blocks of the workers' 16


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    """``kvxfer serve --colocated 2 --routing kv --routing-load-gap 1`` on the simulated
    engine; the ``KVXFER_PAUSE_FILE`` hook (tests/faults) holds a worker's steps so
    its requests stay in flight for as long as the test needs."""
    from serving_server import Server, faults_env

    pause = tmp_path_factory.mktemp("hook") / "pause"
    srv = Server("--colocated", "2", "--routing", "kv", "--routing-load-gap", "1",
                 "--engine", "sim", "--profile", "h100-llama2-7b-vidur",
                 env=faults_env(KVXFER_PAUSE_FILE=str(pause)))
    srv.pause = pause
    try:
        yield srv
    finally:
        srv.stop()


def _inflight(server, worker):
    return {w["name"]: w["inflight"] for w in server.health()["workers"]}[worker]


def _wait_inflight(server, worker, n):
    import time

    deadline = time.monotonic() + 60
    while _inflight(server, worker) != n:
        assert time.monotonic() < deadline, f"{worker} never held {n} requests"
        time.sleep(0.05)


def _metric(text, name, **labels):
    import re

    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}{{{want}}} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name}{{{want}}} not in /metrics"
    return float(m.group(1))


def test_kv_routing_follows_the_cached_prefix_unless_its_worker_is_overloaded(kv_server):
    import threading

    srv = kv_server
    first = srv.complete(PREFIX, max_tokens=1)
    assert first["kvxfer"]["decode_worker"] == "colocated-0"  # equal loads, no hit: the first
    # colocated-0 caches the prefix's 4 blocks (the router knew before the answer came back)
    held = srv.pause.with_name(srv.pause.name + "-colocated-0")
    held.touch()  # colocated-0 takes requests but runs no step
    out: dict = {}

    def later(key, prompt):
        thread = threading.Thread(target=lambda: out.update({key: srv.complete(prompt, max_tokens=2)}),
                                  daemon=True)
        thread.start()
        return thread

    threads = []
    try:
        threads.append(later("other", list(range(5000, 5040))))  # no hit anywhere: least-loaded
        _wait_inflight(srv, "colocated-0", 1)
        # colocated-0 holds one more request than colocated-1 (within the gap of 1) and
        # the prefix: least-loaded would pick colocated-1, kv picks the prefix's worker
        threads.append(later("hit", PREFIX + [7, 8, 9]))
        _wait_inflight(srv, "colocated-0", 2)
        # now 2 over colocated-1's 0, past the gap: the prefix no longer draws the request
        elsewhere = srv.complete(PREFIX + [10, 11], max_tokens=2)
        assert elsewhere["kvxfer"]["decode_worker"] == "colocated-1"
    finally:
        held.unlink()
    for t in threads:
        t.join(60)
    assert out["other"]["kvxfer"]["decode_worker"] == "colocated-0"
    assert out["hit"]["kvxfer"]["decode_worker"] == "colocated-0"

    metrics = srv.client.get("/metrics").text
    routed = {kind: _metric(metrics, "kvxfer_routed_blocks_total", kind=kind, policy="kv",
                            role="colocated") for kind in ("hit", "prompt")}
    # prompts: 64, 40, 67 and 66 tokens -> 3 + 2 + 4 + 4 full blocks counted; hits: the
    # prefix's 4 blocks for the request routed to colocated-0 (colocated-1 held none)
    assert routed == {"hit": 4, "prompt": 13}
    stat = {(w, s): _metric(metrics, "kvxfer_worker_stat", stat=s, worker=w)
            for w in ("colocated-0", "colocated-1") for s in ("prefix_hit_tokens", "prefix_query_tokens")}
    # the worker found in its cache exactly what the router's index said it held
    assert stat["colocated-0", "prefix_hit_tokens"] == 4 * 16
    assert stat["colocated-1", "prefix_hit_tokens"] == 0
    assert stat["colocated-0", "prefix_query_tokens"] == 64 + 40 + 67
    assert stat["colocated-1", "prefix_query_tokens"] == 66


def test_dispatcher_feeds_the_index_drops_bad_messages_and_forgets_the_dead():
    from kvxfer.serving.server.dispatch import Dispatcher
    from kvxfer.serving.server.prom import Registry
    from kvxfer.serving.server.serve_config import ServeConfig

    registry = Registry()
    d = Dispatcher(ServeConfig(num_colocated=2, num_prefill=0, num_decode=0, routing="kv"), registry)
    w0, w1 = d.cluster.workers
    for w in (w0, w1):
        w.is_alive = True
    prompt = list(range(100))  # 6 full blocks of the workers' 16
    h = chain(prompt, 16)
    d.on_message(w1, {"ev": "kv_events", "stored": h, "removed": []})
    assert d.cluster.pick("colocated", prompt) is w1
    assert d.cluster.pick("colocated") is w0  # no prompt: least-loaded, the first
    for bad in ({"ev": "kv_events", "stored": "x"}, {"ev": "kv_events", "removed": [-1]},
                {"ev": "kv_events", "stored": list(range(MAX_EVENT_HASHES + 1))}):
        d.on_message(w1, bad)  # dropped alone, counted; the index is as it was
    assert 'kvxfer_bad_kv_events_total 3.0' in registry.render()
    assert d.cluster.routing.index.num_blocks(w1.name) == len(h)
    w1.is_alive = False
    d.on_worker_exit(w1)
    assert len(d.cluster.routing.index) == 0


def test_dispatcher_books_a_request_until_it_ends():
    from kvxfer.serving.server.dispatch import Dispatcher
    from kvxfer.serving.server.prom import Registry
    from kvxfer.serving.server.serve_config import ServeConfig

    d = Dispatcher(ServeConfig(num_prefill=1, num_decode=2, routing="kv"), Registry())
    for w in d.cluster.workers:
        w.is_alive, w.channel = True, _Channel()
        w.info = {"agent_address": f"127.0.0.1:{len(w.name)}"}
    prefill, decode = d.cluster.role("prefill")[0], d.cluster.role("decode")[0]
    routing = d.cluster.routing
    prompt = list(range(100))  # 6 full blocks of 16, 7 blocks with 12 tokens generated
    st = d.submit("a", prompt, {"max_tokens": 12})
    assert st.decode is decode and st.prefill is prefill
    assert routing.booked(decode.name) == Booking(0, 7) and routing.booked(prefill.name) == Booking(6, 7)
    d.on_message(decode, {"ev": "admitted", "rid": "a", "cached_blocks": 0})
    d.on_message(prefill, {"ev": "token", "rid": "a", "token": 5})
    assert routing.booked(prefill.name) == Booking(0, 7)  # prefilled: only held blocks
    d.on_message(prefill, {"ev": "sent", "rid": "a", "transfer_ms": 1.0})
    assert routing.booked(prefill.name) == Booking(0, 0) and routing.booked(decode.name) == Booking(0, 7)
    d.on_message(decode, {"ev": "done", "rid": "a", "finish_reason": "length"})
    assert routing.booked(decode.name) == Booking(0, 0)
    d.submit("b", prompt, {"max_tokens": 12})
    d.abort("b")  # a request that ends otherwise is released too
    assert all(routing.booked(w.name) == Booking(0, 0) for w in d.cluster.workers)


def test_dispatcher_weighs_the_pools_blocks_in_the_prefill_pick():
    from kvxfer.serving.server.dispatch import Dispatcher
    from kvxfer.serving.server.prom import Registry
    from kvxfer.serving.server.serve_config import ServeConfig

    registry = Registry()
    d = Dispatcher(ServeConfig(num_prefill=2, num_decode=1, routing="kv"), registry)
    for w in d.cluster.workers:
        w.is_alive, w.channel = True, _Channel()
        w.info = {"agent_address": f"127.0.0.1:{len(w.name)}"}
    p0, p1 = d.cluster.role("prefill")
    d.submit("busy", list(range(5000, 5000 + 97)), {"max_tokens": 4})  # 6 blocks to prefill on p0
    prompt = list(range(200))  # 12 full blocks, all in p0's cache
    d.on_message(p0, {"ev": "kv_events", "stored": chain(prompt, 16), "removed": []})
    # local hits only: p0 spares 12 blocks of prefill, worth its 6 pending ones
    assert d.submit("a", prompt, {"max_tokens": 4}).prefill is p0
    d.abort("a")
    # the pool holds all 12: p0's cache is no advantage, and p1 has nothing pending
    assert d.submit("b", prompt, {"max_tokens": 4}, pool_hit_blocks=12).prefill is p1
    assert 'kvxfer_routed_blocks_total{kind="pool",policy="kv",role="prefill"} 12.0' in registry.render()


def test_router_pool_lookup_keys_as_the_prefill_workers_do():
    import asyncio

    from kvxfer import block_keys
    from kvxfer.serving.server.pool_lookup import MAX_WAITING, PoolLookup
    from kvxfer.serving.workers.pool import model_salt

    class Layout:
        def fingerprint(self):
            return "fp"

    worker_salt = model_salt("m", "bf16", Layout())
    held = block_keys(list(range(100)), 16, salt=worker_salt)[:4]

    class Store:
        def __init__(self):
            self.asked = []

        def lookup(self, keys):
            self.asked.append(keys)
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            return n

    store = Store()
    pool = PoolLookup(store, 16)
    info = {"model": "m", "matmul": "bf16", "kv_fingerprint": "fp"}
    try:
        assert asyncio.run(pool.hits(list(range(100)), info)) == 4
        assert len(store.asked[-1]) == 6  # (100 - 1) // 16 full blocks: the last token never counts
        assert asyncio.run(pool.hits(list(range(100)), {**info, "matmul": "fp32"})) == 0  # another model
        asked = len(store.asked)
        assert asyncio.run(pool.hits(list(range(100)), {"model": "m"})) == 0  # no salt: no lookup
        assert asyncio.run(pool.hits([1] * 16, info)) == 0 and len(store.asked) == asked
        pool.waiting = MAX_WAITING  # a full queue: routed without a lookup, counted
        assert asyncio.run(pool.hits(list(range(100)), info)) == 0 and pool.counters["skipped"] == 1
    finally:
        pool._thread.shutdown()


def test_kv_event_batches_keep_every_hash_once_within_the_limit():
    from kvxfer.serving.channel.ipc import kv_event_batches

    stored, removed = list(range(5000)), list(range(10_000, 14_100))
    parts = list(kv_event_batches(stored, removed))
    assert all(0 < len(s) + len(r) <= MAX_EVENT_HASHES for s, r in parts)
    assert sum((s for s, _ in parts), []) == stored and sum((r for _, r in parts), []) == removed
    assert list(kv_event_batches([], [])) == []
