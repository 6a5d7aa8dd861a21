"""The OpenAI-compatible HTTP API of ``kvxfer serve`` through a real uvicorn server.

One disaggregated server (1 prefill + 1 decode worker) for the module; the
last tests kill its workers with SIGKILL: the router restarts them.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from serving_server import Server

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server():
    s = Server("--prefill", "1", "--decode", "1")
    try:
        yield s
    finally:
        s.stop()


def test_completion_non_streaming(server):
    body = server.complete("Once upon a time", max_tokens=4)
    assert body["object"] == "text_completion" and body["model"] == "SmolLM2-135M-Instruct"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 4
    info = body["kvxfer"]
    assert info["kv_bytes"] > 0 and info["kv_transfer_ms"] >= 0 and info["ttft_ms"] > 0
    assert (info["prefill_worker"], info["decode_worker"]) == ("prefill-0", "decode-0")


def test_chat_streaming_matches_non_streaming(server):
    req = {"messages": CHAT, "max_tokens": 5, "temperature": 0}
    full = server.client.post("/v1/chat/completions", json=req).json()
    events = server.stream("/v1/chat/completions", req)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    # the KV transfer field the load generator reads (docs/serving.md)
    assert final["kvxfer"]["kv_bytes"] > 0 and final["kvxfer"]["kv_transfer_ms"] is not None
    assert final["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]


def test_stop_string_and_max_tokens_one(server):
    ref = server.complete("1, 2, 3, 4,", max_tokens=6)["choices"][0]["text"]
    stop = ref.strip()[:2] if ref.strip() else "5"
    cut = server.complete("1, 2, 3, 4,", max_tokens=6, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert stop not in cut["choices"][0]["text"] and ref.startswith(cut["choices"][0]["text"])
    one = server.complete("1, 2, 3, 4,", max_tokens=1)
    assert one["usage"]["completion_tokens"] == 1 and ref.startswith(one["choices"][0]["text"])


def test_seeded_sampling_is_reproducible(server):
    params = {"max_tokens": 5, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    a = server.complete("My favourite food is", **params)
    b = server.complete("My favourite food is", **params)
    assert a["kvxfer"]["token_ids"] == b["kvxfer"]["token_ids"]


def test_bad_requests(server):
    c = server.client
    assert c.post("/v1/completions", json={"prompt": "x", "temperature": -1}).status_code == 400
    assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    # through uvicorn: NaN and a lone surrogate are a 400 with a JSON body, not a reset connection
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "\\ud800"}'):
        r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = c.post("/v1/completions", content=b"{" + b" " * (1 << 20) + b"}",
               headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    r = c.post("/v1/completions", json={"prompt": [1] * 8190, "max_tokens": 8})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": [1] * 4090, "max_tokens": 8})
    assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]  # 256 blocks
    r = c.post("/v1/completions", json={"prompt": [49152], "max_tokens": 1})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


def test_health_and_metrics(server):
    health = server.health()
    assert health["status"] == "ok" and health["mode"] == "disaggregated"
    assert [w["role"] for w in health["workers"]] == ["prefill", "decode"]
    text = server.client.get("/metrics").text
    for name in ("kvxfer_ttft_seconds_count", "kvxfer_tpot_seconds_bucket",
                 "kvxfer_kv_transfer_seconds_count", "kvxfer_kv_transfer_bytes_total",
                 "kvxfer_kv_transfer_failures_total", 'kvxfer_worker_inflight{worker="decode-0"}',
                 'stat="agent_bytes_sent",worker="prefill-0"', 'stat="agent_bytes_received"',
                 'kvxfer_agent_info{key="transport:decode-0"'):
        assert name in text, name
    assert server.client.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def _wait_restarted(server, name: str, old_pid: int, timeout: float = 240.0) -> dict:
    """The /health entry of ``name`` once it runs again under a new pid (bounded wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = server.client.get("/health", timeout=10)
        entry = next(w for w in r.json()["workers"] if w["name"] == name)
        if r.status_code == 200 and entry["alive"] and entry["pid"] != old_pid:
            return entry
        time.sleep(0.5)
    raise AssertionError(f"{name} was not restarted within {timeout:.0f}s: {server.health()}")


def test_killed_decode_worker_fails_its_requests_then_is_restarted(server):
    reference = server.complete("Count: 1, 2, 3,", max_tokens=3)["kvxfer"]["token_ids"]
    decode = next(w for w in server.health()["workers"] if w["role"] == "decode")
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "stream": True}
    errors, num_tokens = [], 0
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                errors.append(payload["error"])
                continue
            num_tokens += 1
            if num_tokens == 3:  # tokens now come from the decode worker: kill it mid-request
                os.kill(decode["pid"], signal.SIGKILL)
    assert errors and "died" in errors[0]["message"], errors
    assert num_tokens < 400
    # while it is down new requests get an answer at once (503), never a hang
    r = server.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code in (200, 503), r.text
    entry = _wait_restarted(server, decode["name"], decode["pid"])
    assert entry["restarts"] == 1 and entry["exit_code"] is None
    again = server.complete("Count: 1, 2, 3,", max_tokens=3)
    assert again["kvxfer"]["token_ids"] == reference
    assert again["kvxfer"]["kv_bytes"] > 0 and again["kvxfer"]["recomputed"] is False
    assert "kvxfer_worker_up{worker=\"decode-0\"} 1" in server.client.get("/metrics").text


def test_killed_prefill_worker_mid_request_then_is_restarted(server):
    reference = server.complete("The sea is", max_tokens=3)["kvxfer"]["token_ids"]
    prefill = next(w for w in server.health()["workers"] if w["role"] == "prefill")
    result: list = []
    body = {"prompt": "word " * 300, "max_tokens": 2, "temperature": 0}
    sender = threading.Thread(target=lambda: result.append(
        server.client.post("/v1/completions", json=body)))
    sender.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the prefill worker holds the request: kill it
        entry = next(w for w in server.health()["workers"] if w["role"] == "prefill")
        if entry["inflight"] or not sender.is_alive():
            break
        time.sleep(0.05)
    os.kill(prefill["pid"], signal.SIGKILL)
    sender.join(timeout=300)
    assert not sender.is_alive() and result, "the request hung"
    r = result[0]  # an error, or the decode worker recomputed the prompt
    assert r.status_code in (200, 500), r.text
    if r.status_code == 500:
        assert "died" in r.json()["error"]["message"]
    entry = _wait_restarted(server, prefill["name"], prefill["pid"])
    assert entry["restarts"] == 1
    again = server.complete("The sea is", max_tokens=3)
    assert again["kvxfer"]["token_ids"] == reference and again["kvxfer"]["kv_bytes"] > 0
