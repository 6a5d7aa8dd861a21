"""GPU profiles: DistServe's published fits imported (kvxfer profile --from-distserve),
tensor-parallel degrees, the causal attention form and DistServe's two decode fits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvxfer.serving.simulated.cost_model import TERMS, StepCostModel, features
from kvxfer.sim.distserve import DATA_DIR, profile_from_distserve
from kvxfer.serving.simulated.profile import ProfileError, load_profile

FITS = os.path.join(DATA_DIR, "profiler-a100-80g.distserve.json")
VLLM_FITS = os.path.join(DATA_DIR, "profiler-a100-80g.vllm.json")


def _ms_distserve(params, lens):
    """DistServe's own simulator (simdistserve/estimators/time_estimator.py, pp 1) plus its
    worker's Ray overhead (Worker.add_ray_overhead), in ms."""
    a, b, c = params["prefill"]
    return a + b * sum(lens) + c * sum(x * x for x in lens) + 1 + 2 + 1e-4 * sum(lens)


def _ms_decode(params, ctxs):
    large = len(ctxs) >= params["decoding_large_small_bs_threshold"]
    a, b, c = params["decoding_largebs" if large else "decoding_smallbs"]
    return a + b * sum(ctxs) + c * len(ctxs) + 2 + 1e-4 * sum(ctxs)


@pytest.mark.parametrize("model", ["facebook/opt-13b", "facebook/opt-66b"])
def test_distserve_fits_give_distserves_step_times_at_every_degree(model):
    raw = json.load(open(FITS))[model]
    prof = profile_from_distserve(FITS, model)
    assert prof.tp_degrees == tuple(sorted(int(k) for k in raw))
    for tp, params in raw.items():
        fit = prof.at_tp(int(tp)).fit
        for lens in ([512], [100, 700, 2000]):
            assert fit.step_seconds([(n, 0) for n in lens]) * 1e3 == pytest.approx(
                _ms_distserve(params, lens), rel=1e-9)
        for batch in (1, 94, 95, 300):  # both sides of the small/large-batch threshold
            ctxs = [300 + 7 * i for i in range(batch)]
            # kvxfer's decode chunk at start s attends to s + 1 tokens: ctx = s + 1
            got = fit.step_seconds([(1, c - 1) for c in ctxs]) * 1e3
            assert got == pytest.approx(_ms_decode(params, ctxs), rel=1e-9)


def test_distserve_capacity_engine_and_links():
    prof = load_profile("a100-opt13b-distserve")
    assert prof.kv_bytes_per_token == 2 * 40 * 5120 * 2
    assert {k: prof.at_tp(k).kv_capacity_tokens for k in prof.tp_degrees} == {
        1: 66144, 2: 163008, 4: 356736}  # max_num_tokens.csv at pp 1
    assert prof.at_tp(2).default_num_blocks(1024) == 163008 // 16
    assert prof.engine["handoff"] == "after-prefill" and prof.engine["modes"] == ["split"]
    from kvxfer.sim.replay import RunOptions

    # DistServe's engine has no chunked prefill: whole prompts, its 8,192-token batches
    assert RunOptions().engine_fields(prof)["schedule"] == "prefill-first"
    assert RunOptions().engine_fields(prof)["max_num_batched_tokens"] == 8192
    vllm = load_profile("a100-opt13b-vllm")
    assert RunOptions().engine_fields(vllm)["schedule"] == "mixed"
    assert RunOptions(chunked_prefill=False).engine_fields(vllm)["max_num_batched_tokens"] == 16384
    assert load_profile("a100-opt13b-vllm").engine["modes"] == ["colocated", "split"]
    assert prof.link_between(True).bandwidth_bytes_per_s > 20 * prof.link_between(False).bandwidth_bytes_per_s
    assert "Apache-2.0" in prof.licence and "82831f16" in prof.source
    with pytest.raises(ProfileError, match="no tensor-parallel degree 3; it has 1, 2, 4"):
        prof.at_tp(3)
    with pytest.raises(ProfileError, match="colocated"):
        prof.check_mode("colocated")
    # the negative coefficient vLLM published for OPT-66B at TP 2 is held at 0, and said
    vllm66 = load_profile("a100-opt66b-vllm")
    assert vllm66.at_tp(2).fit.as_dict()["c_prefill_attention"] == 0.0
    assert "held at 0" in vllm66.terms["notes"]


def test_shipped_distserve_profiles_are_what_the_importer_makes(tmp_path):
    for engine, fits in (("distserve", FITS), ("vllm", VLLM_FITS)):
        for size in ("13b", "66b"):
            name = f"a100-opt{size}-{engine}"
            out = tmp_path / f"{name}.json"
            subprocess.run([sys.executable, "-m", "kvxfer.cli", "profile", "--from-distserve",
                            fits, "--model", f"facebook/opt-{size}", "--out", str(out)],
                           check=True, capture_output=True, timeout=60)
            made, shipped = load_profile(str(out)).as_dict(), load_profile(name).as_dict()
            made.pop("command"), shipped.pop("command")
            assert made == shipped


def test_from_distserve_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ProfileError, match="has no model 'facebook/opt-1b'; it has facebook/opt-13b"):
        profile_from_distserve(FITS, "facebook/opt-1b")
    with pytest.raises(ProfileError, match="cannot read"):
        profile_from_distserve(str(tmp_path / "absent.json"), "facebook/opt-13b")
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", "profile", "--from-distserve", FITS,
                          "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--model" in out.stderr


def test_causal_attention_form_and_large_batch_round_trip():
    # causal: n * (p + n/2) pairs; masked: n * (p + n)
    assert features([(100, 50)], "causal")[2] == 100 * (50 + 50)
    assert features([(100, 50)])[2] == 100 * 150
    fit = StepCostModel((0.01, 1e-4, 2e-8, 0.02, 1e-4, 1e-6, 0.0), "causal", (0.005, 2e-4, 5e-7), 8)
    assert StepCostModel.from_dict(fit.as_dict()) == fit
    small = fit.step_seconds([(1, 99)] * 7)
    assert small == pytest.approx(0.02 + 7 * 1e-4 + 700 * 1e-6)
    assert fit.step_seconds([(1, 99)] * 8) == pytest.approx(0.005 + 8 * 2e-4 + 800 * 5e-7)
    for bad in (dict(attention="flash"), dict(large_batch=(1.0, 2.0)),
                dict(large_batch=(1.0, 1.0, 1.0), large_batch_from=0), dict(large_batch_from=3)):
        with pytest.raises(ValueError):
            StepCostModel((0.0,) * 7, **{"attention": "masked", **bad})


def test_attention_efficiencies_fit_distserves_opt13b_and_make_the_vidur_terms():
    # the method of kvxfer.sim.attention: eta_mem from DistServe's decode b, eta_flop from
    # its prefill c; OPT-13B's b (both batch fits, every degree) within 25% of DistServe's
    from kvxfer.sim.attention import (GPUS, decode_context_seconds, fit_efficiencies,
                                      prefill_attention_seconds)

    eff = fit_efficiencies(FITS)
    assert 0.3 < eff.eta_mem <= 1.0 and 0.05 < eff.eta_flop <= 1.0
    opt13b_b = {k: v for k, v in eff.errors.items() if k.startswith("facebook/opt-13b") and k.endswith(" b")}
    assert len(opt13b_b) == 6  # TP 1, 2, 4 x small and large batch
    assert all(0.75 <= ratio <= 1.25 for ratio in opt13b_b.values()), opt13b_b
    # the shipped Vidur profiles' attention terms are these, at every degree
    for name, gpu, d_model in (("a100-llama2-7b-vidur", "a100", 4096), ("a100-llama3-8b-vidur", "a100", 4096),
                               ("h100-llama2-7b-vidur", "h100", 4096)):
        prof = load_profile(name)
        assert prof.tp_degrees == (1, 2, 4, 8)
        for tp in prof.tp_degrees:
            fit = prof.at_tp(tp).fit
            coef = dict(zip(TERMS, fit.coefficients))
            assert fit.attention == "causal"
            assert coef["e_decode_context"] == pytest.approx(
                decode_context_seconds(prof.kv_bytes_per_token, GPUS[gpu], tp, eff.eta_mem), rel=1e-9)
            assert coef["c_prefill_attention"] >= prefill_attention_seconds(
                d_model, 32, GPUS[gpu], tp, eff.eta_flop) * (1 - 1e-9)
        # an 80 GB A100 holds ~110k tokens of Llama-2-7B KV (the Mooncake prompts of 18-36k fit)
        caps = [prof.at_tp(tp).kv_capacity_tokens for tp in prof.tp_degrees]
        assert caps == sorted(caps) and caps[0] > 100_000
