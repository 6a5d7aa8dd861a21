"""Step logs (kvxfer.serving.engine.step_log) and ``kvxfer profile --from-steps``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.serving.engine.config import EngineConfig
from kvxfer.serving.engine.sampling import SamplingParams
from kvxfer.serving.engine.sequence import Sequence
from kvxfer.serving.engine.step_log import StepLog, read_step_log, step_kind
from kvxfer.serving.simulated.cost_model import StepCostModel
from kvxfer.serving.simulated.profile import load_profile
from kvxfer.serving.simulated.runtime import HOST_OVERLAP_S, SimRuntime


def test_runtime_logs_every_step_it_runs(tmp_path):
    prof = load_profile("h100-llama2-7b-vidur")
    runtime = SimRuntime(EngineConfig(num_blocks=64, max_num_batched_tokens=64), prof)
    runtime.step_log = log = StepLog(str(tmp_path / "w.jsonl"), {"engine": "sim", "name": "w"})
    seqs = [Sequence(list(range(100, 100 + n)), SamplingParams(max_tokens=3, temperature=0))
            for n in (40, 100)]
    for s in seqs:
        runtime.scheduler.add(s)
    ran = []
    while any(not s.is_finished for s in seqs):
        step = runtime.step()
        for seq, token in step.produced:
            seq.token_ids.append(token)
            if seq.num_output_tokens >= 3:
                runtime.scheduler.finish(seq, "length")
        ran.append(step.num_tokens)
    log.close()
    header, points = read_step_log(log.path)
    assert header["engine"] == "sim" and header["name"] == "w" and header["cpus"]
    assert [sum(n for n, _ in p["chunks"]) for p in points] == [n for n in ran if n]
    # 64 tokens a step: the 100-token prompt runs in chunks beside the other's prompt and decode
    assert [p["chunks"] for p in points[:3]] == [[[40, 0], [24, 0]], [[1, 40], [63, 24]],
                                                [[1, 41], [13, 87]]]
    assert {p["kind"] for p in points} >= {"prefill", "decode"}
    # the simulated forward sleeps to its modelled end, counted from the previous step's
    # end where the host's time between them was under HOST_OVERLAP_S (absorbed)
    for p in points:
        assert p["seconds"] >= prof.fit.step_seconds(p["chunks"]) * (1 - 1e-6) - HOST_OVERLAP_S
    assert 0 <= runtime.absorbed_s <= HOST_OVERLAP_S * len(points)
    assert sum(p["seconds"] for p in points) >= (
        sum(prof.fit.step_seconds(p["chunks"]) for p in points) - runtime.absorbed_s) * (1 - 1e-6)
    assert log.num_steps == len(points)


def test_step_kinds():
    assert step_kind([[1, 5], [1, 9]]) == "decode"
    assert step_kind([[16, 0], [40, 16]]) == "prefill"
    assert step_kind([[1, 5], [16, 0]]) == "mixed"


def _write_log(path, header, steps, truth):
    with open(path, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for chunks in steps:
            f.write(json.dumps({"chunks": chunks, "seconds": truth.step_seconds(chunks), "t": 1}) + "\n")


def test_read_step_log_names_the_bad_line_and_skips_a_cut_last_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"header": {"engine": "real"}}\n{"chunks": [[4, 0]], "seconds": 0.1}\n'
                    '{"chunks": [[1, 4]], "sec')  # a killed worker's half-written line
    header, points = read_step_log(str(path))
    assert header == {"engine": "real"} and points == [
        {"kind": "prefill", "chunks": [[4, 0]], "seconds": 0.1}]
    for bad in ('{"chunks": [[0, 0]], "seconds": 0.1}', '{"chunks": [[4, 0]], "seconds": 0}',
                '{"chunks": [], "seconds": 0.1}', '{"seconds": 0.1}', "[1, 2]", "{nope"):
        path.write_text('{"header": {}}\n' + bad + '\n{"chunks": [[4, 0]], "seconds": 0.1}\n')
        with pytest.raises(ValueError, match=r"a\.jsonl:2"):
            read_step_log(str(path))


HEADER = {"engine": "real", "hardware": "Test CPU, 2 cores", "model": "SmolLM2-135M-Instruct",
          "block_size": 16,
          "kv_bytes_per_token": 46080, "matmul": "fp32", "threads": 1, "load_average": 0.5}


def _profile_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", "profile", *args],
                          capture_output=True, text=True, timeout=120)


def test_profile_from_steps_fits_the_logged_steps(tmp_path):
    truth = StepCostModel((0.01, 2e-4, 3e-8, 0.02, 5e-4, 4e-6, 0.007))
    prefill = [[[n, p]] for n in (16, 64, 256, 512) for p in (0, 128, 1024)]
    decode = [[[1, c - 1]] * b for b in (1, 4, 16) for c in (32, 512, 2048)]
    mixed = [[[1, 255]] * b + [[n, 0]] for n in (32, 128) for b in (2, 8)]
    _write_log(tmp_path / "prefill-0.jsonl", {**HEADER, "name": "prefill-0"}, prefill, truth)
    _write_log(tmp_path / "decode-0.jsonl", {**HEADER, "name": "decode-0"}, decode + mixed, truth)
    out = tmp_path / "p.json"
    r = _profile_cli("--from-steps", str(tmp_path / "prefill-0.jsonl"),
                     str(tmp_path / "decode-0.jsonl"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    prof = load_profile(str(out))
    assert prof.fit.coefficients == pytest.approx(truth.coefficients, rel=1e-6)
    assert len(prof.points) == len(prefill) + len(decode) + len(mixed)
    assert prof.name == "p" and prof.kv_bytes_per_token == 46080 and prof.block_size == 16
    assert "--step-log" in prof.source
    assert prof.hardware.startswith("Test CPU, 2 cores; 1 torch thread(s) a worker; 2 serving workers")
    assert prof.residuals["all"]["max_abs"] < 1e-6

    # a simulated engine's log is its own model's sleeps: refused
    _write_log(tmp_path / "sim.jsonl", {**HEADER, "engine": "sim"}, decode, truth)
    r = _profile_cli("--from-steps", str(tmp_path / "sim.jsonl"), "--out", str(tmp_path / "q.json"))
    assert r.returncode != 0 and "not a real engine" in r.stderr
    # logs of different models (KV bytes) do not make one profile
    _write_log(tmp_path / "other.jsonl", {**HEADER, "kv_bytes_per_token": 1024}, decode, truth)
    r = _profile_cli("--from-steps", str(tmp_path / "prefill-0.jsonl"), str(tmp_path / "other.jsonl"),
                     "--out", str(tmp_path / "q.json"))
    assert r.returncode != 0 and "kv_bytes_per_token" in r.stderr
    assert not (tmp_path / "q.json").exists()
