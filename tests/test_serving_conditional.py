"""Conditional disaggregation: a short uncached prompt prefills on the decode worker.

Real processes: ``kvxfer serve --prefill 1 --decode 1 --local-prefill-tokens 8``.
A prompt of token ids lets the test pick exactly how many tokens stay uncached.
"""
from __future__ import annotations

import pytest
from serving_server import Server

pytestmark = pytest.mark.slow

PROMPT = list(range(1000, 1037))  # 37 tokens: 2 full blocks + 5
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server():
    srv = Server("--prefill", "1", "--decode", "1", "--local-prefill-tokens", "8")
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
