"""Disaggregated serving == colocated serving, token for token; failures handled.

Real processes, real HTTP, real KV transfer through kvxfer.Agent. Greedy
decoding; max_tokens small so the suite stays short on two cores.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from serving_server import Server

pytestmark = pytest.mark.slow

SHARED = ("In a small village at the foot of the mountains, there lived an old "
          "clockmaker who repaired every clock in the valley")
PROMPTS = [
    "The capital of France is",                      # < 1 block
    SHARED + ". One winter morning",                 # > 1 block
    SHARED + ", and his daughter, who",              # shares a 2-block prefix with the one above
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def colocated():
    server = Server("--colocated", "1")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory):
    fault_file = tmp_path_factory.mktemp("hook") / "fail-transfers"
    # tests/faults/sitecustomize.py: Agent.send fails in the workers while fault_file exists
    faults = str(Path(__file__).parent / "faults")
    server = Server("--prefill", "1", "--decode", "1", "--on-transfer-failure", "recompute",
                    "--prefill-nice", "5",
                    env={"KVXFER_FAULT_FILE": str(fault_file),
                         "PYTHONPATH": os.pathsep.join([faults, os.environ.get("PYTHONPATH", "")])})
    server.fault_file = fault_file
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(colocated):
    return {p: colocated.complete(p, max_tokens=MAX_TOKENS) for p in PROMPTS}


def test_disaggregated_equals_colocated(disaggregated, reference):
    for prompt in PROMPTS:
        ref = reference[prompt]
        got = disaggregated.complete(prompt, max_tokens=MAX_TOKENS)
        assert got["kvxfer"]["token_ids"] == ref["kvxfer"]["token_ids"], prompt
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        assert got["kvxfer"]["recomputed"] is False
        assert got["kvxfer"]["kv_bytes"] > 0
        assert got["kvxfer"]["kv_transfer_ms"] is not None
    assert ref["kvxfer"]["prefill_worker"] is None  # the baseline moved nothing


def test_prefill_workers_run_at_their_nice_value(disaggregated):
    """--prefill-nice 5: the prefill worker (every thread: set before any starts) runs at 5
    nice levels more than the decode worker (both start at the launcher's level)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    workers = {w["role"]: w for w in disaggregated.health()["workers"]}
    assert workers["decode"]["nice"] == base and workers["prefill"]["nice"] == min(19, base + 5)
    pid = workers["prefill"]["pid"]
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        assert int(stat[16]) == min(19, base + 5)  # field 19 of proc(5): nice


def test_prefix_blocks_are_not_sent_again(disaggregated, reference):
    # PROMPTS[1] ran before: its 2 full blocks are cached on the decode worker
    prompt = PROMPTS[2]
    got = disaggregated.complete(prompt, max_tokens=MAX_TOKENS)
    assert got["kvxfer"]["cached_blocks"] >= 1
    assert got["kvxfer"]["token_ids"] == reference[prompt]["kvxfer"]["token_ids"]
    num_blocks = -(-got["usage"]["prompt_tokens"] // 16)
    per_block = got["kvxfer"]["kv_bytes"] // (num_blocks - got["kvxfer"]["cached_blocks"])
    assert per_block == 30 * 2 * 16 * 3 * 64 * 4  # one fp32 SmolLM2 block, all layers


def test_streamed_disaggregated_text_matches(disaggregated, reference):
    prompt = PROMPTS[1]
    events = disaggregated.stream("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0})
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == reference[prompt]["choices"][0]["text"]
    assert events[-2]["kvxfer"]["kv_bytes"] > 0


def test_transfer_failure_recomputes(disaggregated, reference):
    # the fault hook fails every KV send while this file exists (see workers/prefill.py)
    disaggregated.fault_file.touch()
    try:
        for prompt in PROMPTS[:2]:
            got = disaggregated.complete(prompt, max_tokens=MAX_TOKENS)
            assert got["kvxfer"]["recomputed"] is True
            assert got["kvxfer"]["token_ids"] == reference[prompt]["kvxfer"]["token_ids"], prompt
    finally:
        disaggregated.fault_file.unlink()
    metrics = disaggregated.client.get("/metrics").text
    assert "kvxfer_kv_transfer_failures_total 2" in metrics
    assert "kvxfer_kv_recomputes_total 2" in metrics
    got = disaggregated.complete(PROMPTS[0], max_tokens=2)
    assert got["kvxfer"]["recomputed"] is False
    # blocks of the cancelled recvs come back once the agent released their leases
    want = 'kvxfer_worker_stat{stat="free_blocks",worker="decode-0"} 256'
    deadline = time.monotonic() + 20
    while want not in disaggregated.client.get("/metrics").text and time.monotonic() < deadline:
        time.sleep(0.2)
    assert want in disaggregated.client.get("/metrics").text


def test_sigterm_drains_in_flight_requests(colocated):
    worker_pids = [w["pid"] for w in colocated.health()["workers"]]
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    payloads = []
    with colocated.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:])
                if len(payloads) == 1:
                    colocated.proc.send_signal(signal.SIGTERM)  # router only: it drains the workers
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
    # uvicorn re-raises SIGTERM once it has shut down gracefully
    assert colocated.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in worker_pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
