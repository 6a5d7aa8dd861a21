"""Conditional disaggregation: a short uncached prompt, or any prompt arriving while the
prefill queue is long, prefills on the decode worker.

Real processes: ``kvxfer serve --prefill 1 --decode 1 --local-prefill-tokens 8
--local-prefill-queue 1``. A prompt of token ids lets the test pick exactly how
many tokens stay uncached; the ``KVXFER_PAUSE_FILE`` hook (tests/faults) holds
the prefill worker's steps so its queue is long for as long as the test needs.
"""
from __future__ import annotations

import re
import threading
import time

import pytest
from serving_server import Server, faults_env

pytestmark = pytest.mark.slow

PROMPT = list(range(1000, 1037))  # 37 tokens: 2 full blocks + 5
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pause = tmp_path_factory.mktemp("hook") / "pause"
    srv = Server("--prefill", "1", "--decode", "1", "--local-prefill-tokens", "8",
                 "--local-prefill-queue", "1", env=faults_env(KVXFER_PAUSE_FILE=str(pause)))
    srv.pause = pause
    try:
        yield srv
    finally:
        srv.stop()


def test_short_and_mostly_cached_prompts_prefill_on_the_decode_worker(server):
    short = server.complete("The capital of France is", max_tokens=MAX_TOKENS)
    assert short["kvxfer"]["prefill_worker"] is None and short["kvxfer"]["kv_bytes"] == 0
    assert short["kvxfer"]["decode_worker"] == "decode-0"
    assert short["usage"]["completion_tokens"] == MAX_TOKENS

    remote = server.complete(PROMPT, max_tokens=MAX_TOKENS)  # 37 uncached tokens: remote
    assert remote["kvxfer"]["prefill_worker"] == "prefill-0" and remote["kvxfer"]["kv_bytes"] > 0
    # again: the 2 received blocks are cached on the decode worker, 5 tokens remain
    again = server.complete(PROMPT, max_tokens=MAX_TOKENS)
    assert again["kvxfer"]["cached_blocks"] == 2
    assert again["kvxfer"]["prefill_worker"] is None and again["kvxfer"]["kv_bytes"] == 0
    assert again["kvxfer"]["token_ids"] == remote["kvxfer"]["token_ids"]

    metrics = server.client.get("/metrics").text
    assert 'kvxfer_local_prefills_total{reason="short_prompt"} 2' in metrics
    assert 'kvxfer_worker_stat{stat="local_prefills",worker="decode-0"} 2' in metrics


def test_request_arriving_while_the_prefill_queue_is_long_prefills_locally(server):
    first = list(range(2000, 2040))  # 40 uncached tokens: remote
    second = list(range(3000, 3040))
    reference = server.complete(second, max_tokens=MAX_TOKENS)  # prefill queue empty: remote
    assert reference["kvxfer"]["prefill_worker"] == "prefill-0"

    held = server.pause.with_name(server.pause.name + "-prefill-0")
    held.touch()  # prefill-0 takes requests but runs no step
    out: dict = {}
    blocker = threading.Thread(target=lambda: out.update(r=server.complete(first, max_tokens=MAX_TOKENS)),
                               daemon=True)
    blocker.start()
    try:
        deadline = time.monotonic() + 120
        while 'kvxfer_worker_inflight{worker="prefill-0"} 1' not in server.client.get("/metrics").text:
            assert time.monotonic() < deadline, "first request never reached prefill-0"
            time.sleep(0.1)
        # prefill-0 holds one request (>= --local-prefill-queue 1): this one prefills on decode-0
        local = server.complete(second, max_tokens=MAX_TOKENS)
    finally:
        held.unlink()
    assert local["kvxfer"]["prefill_worker"] is None and local["kvxfer"]["kv_bytes"] == 0
    assert local["kvxfer"]["decode_worker"] == "decode-0"
    assert local["kvxfer"]["token_ids"] == reference["kvxfer"]["token_ids"]
    blocker.join(120)
    assert out["r"]["kvxfer"]["prefill_worker"] == "prefill-0"  # the held one went remote
    assert out["r"]["kvxfer"]["kv_bytes"] > 0
    metrics = server.client.get("/metrics").text
    assert 'kvxfer_local_prefills_total{reason="prefill_queue"} 1' in metrics
    assert re.search(r'kvxfer_local_prefills_total\{reason="short_prompt"\} \d+', metrics)
