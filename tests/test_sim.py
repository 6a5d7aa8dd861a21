"""The simulated engine: cost model fit, profiles, scaled pool, modelled NIC, and a
1P1D simulated server through real HTTP with every transfer verified."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvxfer.errors import KVXferError
from kvxfer.serving.simulated.cost_model import TERMS, StepCostModel, features
from kvxfer.serving.simulated.link import Link, NicQueue
from kvxfer.serving.simulated.profile import Profile, ProfileError, load_profile, residuals, shipped_profiles


def _model(*coefs):
    return StepCostModel(tuple(coefs))


def test_features_reduce_to_distserve_forms():
    # prefill without prefix: a + b*sum(len) + c*sum(len^2)
    assert features([(100, 0), (20, 0)]) == (1.0, 120.0, 100 * 100 + 20 * 20, 0.0, 0.0, 0.0, 0.0)
    # decode: a + d*batch + e*sum(ctx); a one-token chunk at start s has context s + 1
    assert features([(1, 9), (1, 99)]) == (0.0, 0.0, 0.0, 1.0, 2.0, 110.0, 0.0)
    # mixed, with a cached prefix of 32 tokens under a 16-token chunk: a_mixed's 1 last
    assert features([(1, 9), (16, 32)]) == (1.0, 16.0, 16 * 48, 0.0, 1.0, 10.0, 1.0)
    with pytest.raises(ValueError):
        features([(0, 0)])


def test_fit_recovers_known_coefficients():
    truth = _model(0.01, 2e-4, 3e-8, 0.02, 5e-4, 4e-6, 0.007)
    steps = [[(n, p)] for n in (16, 64, 256, 512) for p in (0, 128, 1024)]
    steps += [[(1, c - 1)] * b for b in (1, 4, 16) for c in (32, 512, 2048)]
    steps += [[(1, 255)] * b + [(n, 0)] for n in (32, 128) for b in (2, 8)]
    fit = StepCostModel.fit([(s, truth.step_seconds(s)) for s in steps])
    assert fit.coefficients == pytest.approx(truth.coefficients, rel=1e-6)
    held = StepCostModel.fit([(s, truth.step_seconds(s)) for s in steps],
                             terms=[t for t in TERMS if t != "e_decode_context"])
    assert held.as_dict()["e_decode_context"] == 0.0
    # a fit without a_mixed (profiles fitted before it) reads it as 0; the others are required
    old = {k: v for k, v in truth.as_dict().items() if k != "a_mixed"}
    assert StepCostModel.from_dict(old).as_dict() == {**old, "a_mixed": 0.0}
    with pytest.raises(ValueError, match="a_decode"):
        StepCostModel.from_dict({k: v for k, v in old.items() if k != "a_decode"})


def test_fit_keeps_coefficients_non_negative():
    # time falls with prompt tokens: the tokens term must be dropped, not go negative
    steps = [([(n, 0)], 1.0 - n * 1e-4) for n in (16, 64, 256, 512, 1024, 2048, 4096)]
    fit = StepCostModel.fit(steps)
    assert all(v >= 0 for v in fit.coefficients)
    with pytest.raises(ValueError):
        StepCostModel.fit(steps[:3])
    with pytest.raises(ValueError):
        _model(0.1, -1, 0, 0, 0, 0, 0)


def _profile(**kw) -> Profile:
    fit = _model(0.01, 1e-4, 0, 0.005, 1e-3, 1e-6, 0)
    points = [{"kind": "prefill", "chunks": [[64, 0]], "seconds": 0.02},
              {"kind": "decode", "chunks": [[1, 10]] * 2, "seconds": 0.013}]
    args = dict(name="t", hardware="test box", model="m", dtype="fp32", block_size=16,
                kv_bytes_per_token=1024, fit=fit, link=Link(1e9, 1e-5, "test"),
                points=tuple(points), residuals=residuals(fit, points), source="s",
                licence="MIT")
    args.update(kw)
    return Profile(**args)


def test_profile_json_round_trip(tmp_path):
    prof = _profile()
    path = str(tmp_path / "p.json")
    prof.save(path)
    back = load_profile(path)
    assert back.as_dict() == prof.as_dict()
    assert back.fit.step_seconds([(64, 0)]) == prof.fit.step_seconds([(64, 0)])
    assert back.residuals["all"]["n"] == 2


def test_bad_profiles_raise_typed_errors(tmp_path):
    with pytest.raises(ProfileError, match="no shipped profile"):
        load_profile("no-such-profile")
    assert issubclass(ProfileError, KVXferError) and issubclass(ProfileError, ValueError)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        load_profile(str(bad))
    raw = _profile().as_dict()
    for mutate in (lambda r: r.pop("fit"), lambda r: r["fit"].update(a_prefill=-1.0),
                   lambda r: r.update(block_size=0), lambda r: r["link"].update(bandwidth_bytes_per_s=0),
                   lambda r: r["points"].append({"kind": "warp", "chunks": [[1, 0]], "seconds": 1})):
        doc = json.loads(json.dumps(raw))
        mutate(doc)
        bad.write_text(json.dumps(doc))
        with pytest.raises(ProfileError):
            load_profile(str(bad))
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(str(tmp_path / "absent.json"))
    with pytest.raises(TypeError):
        load_profile(None)


def test_shipped_profiles_load_and_name_their_source():
    names = shipped_profiles()
    assert "cpu-smollm2" in names and any("vidur" in n for n in names)
    for name in names:
        prof = load_profile(name)
        # measured points, or a source that published fits only (DistServe's)
        assert prof.name == name and prof.source and (prof.points or "no measured points" in prof.source)
        if "vidur" in name:
            assert "MIT" in prof.licence and "microsoft/vidur@" in prof.source
            # K and V, 32 layers, head dim 128, fp16: Llama-2-7B has 32 KV heads, Llama-3-8B 8
            kv_heads = {"Llama-2-7b-hf": 32, "Meta-Llama-3-8B": 8}[prof.model]
            assert prof.kv_bytes_per_token == 2 * 32 * kv_heads * 128 * 2
            assert prof.model in prof.source


def test_profile_list_prints_one_name_a_line():
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", "profile", "--list"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == shipped_profiles()


def test_nic_queues_transfers_that_share_it():
    nic = NicQueue(Link(1e9, 1e-3))
    assert nic.reserve(10.0, 10**9) == (10.0, 11.001)
    # ready at the same time: waits for the first to leave the wire
    assert nic.reserve(10.0, 10**9) == (11.0, 12.001)
    assert nic.reserve(20.0, 0) == (20.0, 20.001)


def test_pool_content_is_verifiable_and_prefix_stable():
    from kvxfer.serving.simulated.pool import SimPool

    pool = SimPool(16, 16, real_block_bytes=737280, kv_scale=256)
    assert pool.cache.bytes_per_block * pool.scale == 737280
    prompt = list(range(100, 140))  # 3 blocks, the last partial
    pool.fill(prompt, [5, 2, 9], 0, 2)
    assert pool.verify(prompt, [5, 2, 9], 0)
    assert not pool.verify(prompt[:-1] + [7], [5, 2, 9], 0)  # other last token
    pool.fill(prompt[:32] + [1, 2], [7, 8, 3], 0, 2)  # same 2-block prefix
    assert pool.verify(prompt, [7, 8, 9], 0)
    pool.cache.tensor.view(16, -1)[9, 17] += 1
    assert not pool.verify(prompt, [5, 2, 9], 0)
    assert pool.verify(prompt, [5, 2, 9], 3)  # nothing past the prompt to check


def test_sim_step_imports_no_model_code():
    code = (
        "import sys\n"
        "from kvxfer.serving.simulated.runtime import SimRuntime\n"
        "from kvxfer.serving.simulated.profile import load_profile\n"
        "from kvxfer.serving.engine.config import EngineConfig\n"
        "from kvxfer.serving.engine.sequence import Sequence\n"
        "from kvxfer.serving.engine.sampling import SamplingParams\n"
        "r = SimRuntime(EngineConfig(num_blocks=8), load_profile('h100-llama2-7b-vidur'))\n"
        "s = Sequence(list(range(100, 120)), SamplingParams(max_tokens=2, temperature=0))\n"
        "r.scheduler.add(s)\n"
        "step = r.step()\n"
        "assert step.produced and r.pool.verify(s.token_ids, s.block_table, 0)\n"
        "assert r.modelled_s > 0\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvxfer.serving.model')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "kvxfer.serving.model.model" not in out and "attention" not in out


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory):
    from serving_server import Server

    log_dir = str(tmp_path_factory.mktemp("steps"))
    server = Server("--prefill", "1", "--decode", "1", "--engine", "sim",
                    "--profile", "h100-llama2-7b-vidur", "--step-log", log_dir)
    server.step_log_dir = log_dir
    yield server
    server.stop()


def test_sim_server_answers_max_tokens_and_verifies_every_transfer(sim_server):
    prof = load_profile("h100-llama2-7b-vidur")
    prompts = ["the quick brown fox " * (4 + i) for i in range(4)]
    answers = [sim_server.complete(p, max_tokens=5 + i, ignore_eos=True) for i, p in enumerate(prompts)]
    for i, body in enumerate(answers):
        assert body["usage"]["completion_tokens"] == 5 + i
        assert body["kvxfer"]["kv_bytes"] > 0 and body["kvxfer"]["prefill_worker"] == "prefill-0"
        # the reported transfer time is the real model's bytes over the modelled link
        # (at least; queueing behind earlier transfers adds to it). The worker derives it
        # from perf_counter() instants, whose difference is exact only to ~1e-8 relative.
        blocks = -(-body["usage"]["prompt_tokens"] // prof.block_size) - body["kvxfer"]["cached_blocks"]
        modelled_ms = prof.link.seconds(blocks * prof.block_bytes) * 1e3
        assert body["kvxfer"]["kv_transfer_ms"] >= modelled_ms * (1 - 1e-6)
    # deterministic tokens: the same prompt gives the same answer
    again = sim_server.complete(prompts[0], max_tokens=5, ignore_eos=True)
    assert again["kvxfer"]["token_ids"] == answers[0]["kvxfer"]["token_ids"]
    metrics = sim_server.client.get("/metrics").text

    def stat(name):
        m = re.search(rf'kvxfer_worker_stat{{stat="{name}",worker="decode-0"}} ([0-9.]+)', metrics)
        return float(m.group(1))

    assert stat("kv_verified") == stat("recv_ok") == 5
    assert stat("kv_mismatched") == 0
    health = sim_server.health()
    assert all(w["matmul"] == "sim:h100-llama2-7b-vidur" for w in health["workers"])


def test_sim_server_workers_log_their_steps(sim_server):
    from kvxfer.serving.engine.step_log import read_step_log
    from kvxfer.serving.simulated.runtime import HOST_OVERLAP_S

    sim_server.complete("a prompt of some words " * 8, max_tokens=4, ignore_eos=True)
    prof = load_profile("h100-llama2-7b-vidur")
    for name in ("prefill-0", "decode-0"):
        header, points = read_step_log(os.path.join(sim_server.step_log_dir, f"{name}.jsonl"))
        assert header["name"] == name and header["engine"] == "sim" and header["hardware"]
        assert header["kv_bytes_per_token"] == prof.kv_bytes_per_token
        assert points and all(p["seconds"] >= prof.fit.step_seconds(p["chunks"]) * (1 - 1e-6)
                              - HOST_OVERLAP_S for p in points)
        kinds = {p["kind"] for p in points}
        # a fully cached prompt leaves one token to prefill: a one-token chunk counts as decode
        assert "prefill" in kinds if name == "prefill-0" else kinds == {"decode"}


def test_sim_server_takes_prompts_past_the_embedded_models_context():
    # the simulated engine's limit is its KV pool (1,024 blocks of 16 tokens here), as on
    # the virtual clock, not the embedded tokenizer's model context (8,192 tokens)
    from serving_server import Server

    server = Server("--prefill", "1", "--decode", "1", "--engine", "sim",
                    "--profile", "h100-llama2-7b-vidur", "--num-blocks", "1024")
    try:
        prompt = "the quick brown fox " * 2300
        body = server.complete(prompt, max_tokens=2, ignore_eos=True)
        assert body["usage"]["prompt_tokens"] > 8192
        assert body["usage"]["completion_tokens"] == 2
        r = server.client.post("/v1/completions", json={"prompt": prompt * 2, "max_tokens": 2})
        assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_shared_devices_slow_steps_by_the_busy_share(tmp_path):
    from kvxfer.serving.simulated.devices import QUANTUM_S, SharedDevices, create_device_file

    path = create_device_file(4)
    try:
        me, other1, other2 = (SharedDevices(path, i, 2) for i in range(3))
        now = [0.0]

        def sleep(dt):  # a fake clock: the other workers end their steps at t = 0.3
            now[0] += dt
            if now[0] >= 0.3 - 1e-12:
                other1._mm[other1.slot] = other2._mm[other2.slot] = 0

        other1._mm[1] = other2._mm[2] = 1
        assert me.busy() == 2
        # 3 busy on 2 devices: 2/3 speed until 0.3 (0.2 of work done), then alone: 0.2 more
        end = me.run(0.4, 0.0, clock=lambda: now[0], sleep=sleep)
        assert now[0] == pytest.approx(0.5, abs=2 * QUANTUM_S) and end == pytest.approx(0.5, abs=2 * QUANTUM_S)
        assert me.busy() == 0
        # alone on the devices: exactly the modelled time
        now[0] = 1.0
        assert me.run(0.25, 1.0, clock=lambda: now[0], sleep=sleep) == pytest.approx(1.25, abs=1e-9)
        assert now[0] == pytest.approx(1.25, abs=1e-9)
        with pytest.raises(ValueError):
            SharedDevices(path, 4, 2)
        with pytest.raises(ValueError):
            SharedDevices(path, 0, 0)
        other1._mm[1] = 1
        SharedDevices(path, 1, 2)  # a restarted worker clears its own slot
        assert me.busy() == 0
        for d in (me, other1, other2):
            d.close()
    finally:
        os.unlink(path)


def test_sim_server_workers_share_the_devices_file_it_makes():
    import glob

    from serving_server import Server

    server = Server("--prefill", "2", "--decode", "1", "--engine", "sim",
                    "--profile", "h100-llama2-7b-vidur", "--sim-devices", "2")
    try:
        body = server.complete("the quick brown fox " * 8, max_tokens=3, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 3
        shares = set()
        for w in server.health()["workers"]:
            with open(f"/proc/{w['pid']}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            assert argv[argv.index("--sim-devices") + 1] == "2"
            shares.add(argv[argv.index("--sim-share") + 1])
        paths = {s.rpartition(":")[0] for s in shares}
        assert len(shares) == 3 and len(paths) == 1  # one file, a slot each
        (path,) = paths
        assert os.path.exists(path) and os.path.getsize(path) == 3
    finally:
        server.stop()
    assert not os.path.exists(path) and not glob.glob(f"/dev/shm/kvxfer-sim-devices-{server.proc.pid}-*")


def test_serve_cli_takes_the_config_grammar_and_the_profiles_engine():
    import argparse

    from kvxfer.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    config = serve.config_from_args(parser.parse_args(
        ["serve", "--config", "1P2D@2,1", "--engine", "sim", "--profile", "a100-opt13b-vllm",
         "--no-enable-chunked-prefill"]))
    assert [(s.role, s.tp) for s in config.worker_specs()] == [("prefill", 2), ("decode", 1),
                                                                ("decode", 1)]
    # whole prompts first, with the profiled engine's budgets; the pool: its capacity
    assert (config.schedule, config.max_num_seqs, config.max_num_batched_tokens,
            config.num_blocks) == ("prefill-first", 1024, 16384, None)
    config = serve.config_from_args(parser.parse_args(["serve", "--config", "conditional:1P1D"]))
    assert config.local_prefill_tokens > 0 and (config.max_num_seqs, config.num_blocks) == (16, None)
    for argv, message in ((["--config", "1P1D@2"], "--engine sim only"),
                          (["--config", "1P1D", "--prefill", "2"], "excludes"),
                          (["--config", "2X"], "unknown configuration")):
        with pytest.raises(ValueError, match=message):
            serve.config_from_args(parser.parse_args(["serve", *argv]))


def test_sim_server_with_tp_degrees_holds_the_profiles_capacity():
    # an A100 with Llama-2-7B holds ~118k tokens of KV (the profile's capacity at TP 1), not
    # the CPU engine's 16,384: a 30k-token prompt is served; the router's limit is the
    # smaller worker's pool (the TP-1 decode worker's, not the TP-2 prefill worker's)
    from serving_server import Server

    prof = load_profile("a100-llama2-7b-vidur")
    server = Server("--config", "1P1D@2,1", "--engine", "sim", "--profile", prof.name,
                    "--sim-kv-scale", "4096", "--no-enable-chunked-prefill", num_blocks=None)
    try:
        body = server.complete("the quick brown fox " * 7500, max_tokens=2, ignore_eos=True)
        assert body["usage"]["prompt_tokens"] > 16384 and body["usage"]["completion_tokens"] == 2
        blocks = -(-body["usage"]["prompt_tokens"] // prof.block_size)
        # two GPUs' links send it: the transfer takes at least the bytes over twice the link
        assert body["kvxfer"]["kv_transfer_ms"] >= 1e3 * prof.link.wide(2).seconds(
            blocks * prof.block_bytes) * (1 - 1e-6)
        r = server.client.post("/v1/completions", json={"prompt": "a " * 120000, "max_tokens": 2})
        limit = prof.at_tp(1).default_num_blocks(0) * prof.block_size
        assert r.status_code == 400 and f"KV pool ({limit} tokens)" in r.json()["error"]["message"]
    finally:
        server.stop()
