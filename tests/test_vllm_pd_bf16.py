"""Real vLLM engines with KVXferConnector in bf16: D computes what one engine computes.

D loads the first ``n - 1`` prompt tokens' KV from P and computes only the last prompt
token over them (vLLM recomputes the last token of a fully loaded prompt to get its
logits). A cold engine instead prefills all ``n`` tokens in one pass. In fp32 the two
agree (tests/test_vllm_pd.py checks D against the cold run bitwise); in bf16 they take
different kernel shapes, and on CPUs without AMX (the ``vec`` attention path, AVX-512
or AVX2 matmuls) their logits differ by a few hundredths of a nat, enough to flip a
greedy choice at a near tie (docs/vllm.md, "bf16 and the CPU kernel path").

So the bitwise oracle here is the computation D does, done by one engine alone: a
plain bf16 engine serves each prompt cold (as P does), then serves it again from its
own prefix cache. For prompts of ``k * block_size + 1`` tokens that second run hits
``n - 1`` tokens and computes only the last one, exactly as D does over P's KV; D's
tokens and log-probabilities must equal it bit for bit. Prompts of other lengths
(shorter than a block, one block, a partial last block) have no such single-engine
twin: for them, D must agree with the cold run token for token up to the first near
tie, where D's token must be one the cold run scored within ``TIE_NATS`` of its own
choice. Assertion messages name the CPU attention path the oracle ran on.
"""
from __future__ import annotations

import json
import os
import random

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from vllm_procs import BLOCK_SIZE, VllmServer, start_all, timed_prefill  # noqa: E402

MAX_TOKENS = 8
TOP = 5  # log-probabilities per position requested from every engine
# Where D and the cold run part, the cold run's score of D's token must be this close
# to its own choice: two bf16 ulps of logits around 16-32 (measured cold-vs-cached
# differences on the vec path: 0.02-0.06 nats; exact ties are common in bf16).
TIE_NATS = 0.25
B = BLOCK_SIZE


def _prompts() -> tuple[dict, set]:
    """``{name: ids}`` in serving order, and the names with a single-engine twin."""
    rng = random.Random(11)

    def ids(n):
        return [rng.randrange(200, 40000) for _ in range(n)]

    long = ids(3 * B + 5)
    prompts = {"short": ids(7), "one_block": ids(B), "long": long,
               # D holds the first two blocks itself (from "long"): only the tail moves
               "shared_prefix": long[:2 * B] + ids(9)}
    three = ids(3 * B + 1)
    prompts.update({"one_block_plus_one": ids(B + 1), "three_blocks_plus_one": three,
                    "shared_prefix_plus_one": three[:2 * B] + ids(B + 1)})
    twins = {name for name, p in prompts.items() if len(p) % B == 1}
    return prompts, twins


PROMPTS, TWINS = _prompts()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvxfer.integrations.hf_export import export_hf

    return export_hf(str(tmp_path_factory.mktemp("smollm2-hf-bf16")), dtype="bfloat16")


def _kernel_path(model_dir: str) -> str:
    """vLLM CPU's attention path for this model in bf16 (``amx``, ``vec``, ...)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return _get_attn_isa(torch.bfloat16, B, head_dim, "auto")


def _answer(r: dict) -> dict:
    """Tokens, chosen-token log-probabilities and top-``TOP`` maps (keyed ``token_id:N``)."""
    assert r["status"] == 200, r
    choice = r["choices"][0]
    lp = choice["logprobs"]
    details = (r.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"tokens": list(choice["token_ids"]), "logprobs": lp["token_logprobs"],
            "top": lp["top_logprobs"], "cached": details.get("cached_tokens") or 0}


def _references(model_dir: str) -> dict:
    """A plain bf16 engine alone: each prompt cold (in P's order), then from its own cache."""
    base = VllmServer(model_dir, "bfloat16", kv_bytes=256 << 20, max_model_len=2048)
    try:
        start_all([base])
        timing = max(PROMPTS.values(), key=len)
        timed_prefill(base, [t + 3 for t in timing])  # warm-up
        refs = {"prefill_s": timed_prefill(base, [t + 5 for t in timing]), "cold": {}, "cached": {}}
        for name, ids in PROMPTS.items():
            refs["cold"][name] = _answer(base.complete(ids, MAX_TOKENS, logprobs=TOP))
            if name in TWINS:
                refs["cached"][name] = _answer(base.complete(ids, MAX_TOKENS, logprobs=TOP))
        return refs
    finally:
        base.stop()


def _cold_agreement(d: dict, cold: dict, where: str) -> None:
    """D equals the cold run up to the first position where the cold run has a near tie."""
    for i, (mine, theirs) in enumerate(zip(d["tokens"], cold["tokens"])):
        if mine == theirs:
            continue
        best = cold["logprobs"][i]
        score = cold["top"][i].get(f"token_id:{mine}")
        assert score is not None and best - score <= TIE_NATS, (
            f"{where}: D's token {mine} at position {i} is not a near tie of the cold run's "
            f"{theirs} (cold top: {cold['top'][i]}, D top: {d['top'][i]})")
        return


def test_bf16_decode_after_transfer_equals_single_engine(model_dir):
    path = _kernel_path(model_dir)
    refs = _references(model_dir)
    for name in TWINS:  # the oracle is what we say it is: only the last token computed
        assert refs["cached"][name]["cached"] == len(PROMPTS[name]) - 1, (name, refs["cached"][name])
    budget = max(30.0, 40.0 * refs["prefill_s"])
    common = dict(kv_bytes=256 << 20, max_model_len=2048)
    p = VllmServer(model_dir, "bfloat16", "producer", lease_timeout=4 * budget, **common)
    d = VllmServer(model_dir, "bfloat16", "consumer", policy="fail", recv_timeout=budget, **common)
    try:
        start_all([p, d])
        ext_before = d.metric("vllm:external_prefix_cache_hits_total")
        for name, prompt in PROMPTS.items():
            params = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True},
                                timeout=4 * budget)["kv_transfer_params"]
            # policy "fail": a failed load would show here as a non-200
            got = _answer(d.complete(prompt, MAX_TOKENS, kv_transfer_params=params,
                                     timeout=4 * budget, logprobs=TOP))
            where = f"{name} (bf16, CPU attention path {path!r})"
            if name in TWINS:
                twin = refs["cached"][name]
                assert (got["tokens"], got["logprobs"], got["top"]) == (
                    twin["tokens"], twin["logprobs"], twin["top"]), (
                    f"{where}: D differs from one engine serving the prompt from its own prefix "
                    f"cache: tokens {got['tokens']} vs {twin['tokens']}, log-probabilities "
                    f"{got['logprobs']} vs {twin['logprobs']}")
            _cold_agreement(got, refs["cold"][name], where)
        # D held each shared prefix's first two blocks itself; everything else was loaded
        loaded = sum(len(v) for v in PROMPTS.values()) - 4 * B
        assert d.metric("vllm:external_prefix_cache_hits_total") - ext_before == loaded
    finally:
        p.stop()
        d.stop()
