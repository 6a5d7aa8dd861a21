"""kvxfer plan: the tensor-parallel grammar, the capacity search (bisection on the rate
grid, the early stop, branch and bound against the exhaustive search), per-worker TP
on the virtual clock, DistServe's handoff and swap, whole prompts first, the CLI."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from kvxfer.loadgen.metrics import SLO, summarize_run
from kvxfer.sim.configs import (ConfigError, canonical, gpus_of, layout_of, parse_config,
                                placements)
from kvxfer.serving.simulated.cost_model import StepCostModel
from kvxfer.serving.simulated.link import Link
from kvxfer.sim.plan import (K_MIN, Planner, PlanSpec, SLOWatch, attainment, capacity_probes,
                             grid_index, grid_rate)
from kvxfer.serving.simulated.profile import Profile, ProfileError, load_profile
from kvxfer.sim.replay import RunOptions, TraceSlice, run_config
from kvxfer.sim.vclock import simulate
from kvxfer.sim.virtual_worker import place_on_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAREGPT = os.path.join(ROOT, "benchmarks", "traces", "sharegpt_opt13b_distserve.jsonl")
FIT1 = StepCostModel((0.01, 1e-4, 0.0, 0.005, 1e-3, 1e-6, 0.0), "causal")
FIT2 = StepCostModel((0.008, 5e-5, 0.0, 0.004, 5e-4, 5e-7, 0.0), "causal")


def _profile(**kw) -> Profile:
    args = dict(name="tp", hardware="test", model="m", dtype="fp16", block_size=16,
                kv_bytes_per_token=1 << 16, fit=FIT1, link=Link(1e9, 1e-5, "net"),
                kv_capacity_tokens=64 * 16, tensor_parallel={2: (FIT2, 160 * 16)},
                node_link=Link(1e11, 1e-6, "nvlink"), gpus_per_node=4, source="s")
    args.update(kw)
    return Profile(**args)


# ---- the grammar -------------------------------------------------------------------
def test_tp_suffix_grammar_parses_and_counts_gpus():
    assert layout_of("1P1D@2,1")[1:] == (1, 1, 2, 1) and gpus_of("1P1D@2,1") == 3
    assert gpus_of("colocated:3@4") == 12 and gpus_of("2P6D") == 8 and gpus_of("2p2d@2") == 8
    assert canonical("2p6d@1,1") == "2P6D" and canonical("1P1D@2,2") == "1P1D@2"
    assert canonical("adaptive:1p2d@2,1") == "adaptive:1P2D@2,1"
    c = parse_config("1P2D@2,1")
    assert [(s.role, s.tp) for s in c.worker_specs()] == [("prefill", 2), ("decode", 1), ("decode", 1)]
    assert [s.tp for s in parse_config("colocated:2@4").worker_specs()] == [4, 4]
    with pytest.raises(ConfigError, match=r"colocated:N\[@K\], xPyD\[@A\[,B\]\]"):
        parse_config("3Q@2")


def test_placements_fit_the_gpus_at_the_given_degrees():
    names = placements(4, (1, 2))
    assert len(names) == len(set(names)) and all(gpus_of(n) <= 4 for n in names)
    assert {"colocated:4", "colocated:2@2", "1P1D@2,1", "1P2D@2,1", "3P1D", "1P1D@2"} <= set(names)
    assert "colocated:1@4" not in names and "2P1D@2,1" not in names  # 5 GPUs
    assert placements(4, (1, 2), ["split"]) == [n for n in names if not n.startswith("colocated")]
    assert len(placements(8, (1, 2, 4))) == 85


def test_a_tp_degree_the_profile_lacks_fails_naming_the_ones_it_has():
    with pytest.raises(ProfileError, match="no tensor-parallel degree 4; it has 1, 2"):
        simulate(parse_config("1P1D@4,1"), _profile(), [(0.0, list(range(40)), 2)])
    spec = PlanSpec(gpus=4, slo=SLO(1000, 100), tps=(1, 4))
    from kvxfer.sim.plan import candidates

    with pytest.raises(ValueError, match="has tensor-parallel degrees 1, 2; --tp asked for 4"):
        candidates(spec, _profile())
    with pytest.raises(ValueError, match=r"degrees must be ints in 1\.\.2 \(--gpus\)"):
        PlanSpec(gpus=2, slo=SLO(1000, 100), tps=(1, 4))
    with pytest.raises(ValueError, match="attainment-mode"):
        PlanSpec(gpus=2, slo=SLO(1000, 100), mode="most")


# ---- per-worker TP, links, pools ---------------------------------------------------
def test_workers_take_their_degrees_fit_capacity_and_links():
    prof = _profile()
    prompt = list(range(16 * 20))  # 20 blocks
    res = simulate(parse_config("1P1D@2,1"), prof, [(0.0, prompt, 3)])
    rec = res.records[0]
    # prefill on TP 2 (FIT2), then 20 blocks over NVLink two GPUs wide (one node of 4)
    assert rec["ttft_s"] == pytest.approx(FIT2.step_seconds([(320, 0)]))
    nbytes = 20 * prof.block_bytes
    assert rec["kv_transfer_ms"] == pytest.approx(1e3 * (nbytes / 2e11 + 1e-6))
    # decode on TP 1 (FIT1), after the transfer landed on its single NVLink
    first_gap = (nbytes / 1e11 + 1e-6) + FIT1.step_seconds([(1, 320)])
    assert rec["e2e_s"] - rec["ttft_s"] == pytest.approx(first_gap + FIT1.step_seconds([(1, 321)]))
    # pools: each worker's capacity at its degree; the router refuses what the smaller can't hold
    big = simulate(parse_config("1P1D@2,1"), prof, [(0.0, list(range(16 * 70)), 2)])
    assert big.records[0]["ok"] is False and "1024 tokens" in big.records[0]["error"]
    assert simulate(parse_config("1P1D@2"), prof, [(0.0, list(range(16 * 70)), 2)]).records[0]["ok"]
    # across nodes: the network
    assert place_on_nodes([2, 1, 2, 1], 4) == [0, 0, 1, 1] and place_on_nodes([1, 1, 1, 1, 1], 4) == [0, 0, 0, 0, 1]
    far = simulate(parse_config("1P4D@2,1"), prof, [(0.0, prompt, 2)] * 5)
    assert {r["decode"] for r in far.records} == {f"decode-{i}" for i in range(4)}
    slow = [r for r in far.records if r["decode"] in ("decode-2", "decode-3")]  # on node 1
    assert all(r["kv_transfer_ms"] >= 1e3 * nbytes / 2e9 for r in slow)


# ---- whole prompts first, DistServe's handoff and swap -----------------------------
def test_whole_prompts_first_hold_back_the_running_decodes():
    from kvxfer.sim.vclock import VirtualCluster

    prof = _profile()
    first, second = list(range(64)), list(range(1000, 1000 + 800))
    stall = {}
    for schedule, budget in (("mixed", 128), ("prefill-first", 4096)):
        cluster = VirtualCluster(parse_config("colocated:1", schedule=schedule,
                                              max_num_batched_tokens=budget), prof)
        cluster.run([(0.0, first, 40), (0.05, second, 2)])
        times = next(r.token_times for r in cluster.finished if len(r.prompt_ids) == 64)
        stall[schedule] = max(b - a for a, b in zip(times, times[1:]))
    # chunked: the 800-token prompt runs in 128-token chunks beside the running decode;
    # whole prompts first: the decode waits for one 800-token step
    assert stall["prefill-first"] >= FIT1.step_seconds([(800, 0)])
    assert stall["mixed"] < FIT1.step_seconds([(1, 100), (128, 0)]) * 1.01


def _distserve_like(**engine):
    return _profile(engine={"name": "DistServe-like", "modes": ["split"], "handoff": "after-prefill",
                            "preemption": "swap", "swap_bytes_per_s": 1e10, **engine},
                    kv_capacity_tokens=40 * 16)


def test_after_prefill_handoff_waits_for_decode_blocks_with_the_prefill_holding_them():
    prof = _distserve_like()
    # decode holds 40 blocks: the first request (30 blocks + answer) fills it, the second
    # (20 blocks) is prefilled at once but waits for the first to end before its KV moves
    a, b = list(range(16 * 30)), list(range(5000, 5000 + 16 * 20))
    res = simulate(parse_config("1P1D@2,1"), prof, [(0.0, a, 40), (0.01, b, 5)])
    ra, rb = sorted(res.records, key=lambda r: r["sent_s"])
    assert rb["ttft_s"] < 0.1  # its prefill did not wait
    end_a = ra["sent_s"] + ra["e2e_s"]
    assert rb["sent_s"] + rb["e2e_s"] > end_a  # its decode did
    with pytest.raises(ValueError, match="after prefill"):
        simulate(parse_config("conditional:1P1D"), prof, [(0.0, a, 2)])
    with pytest.raises(ProfileError, match="split configurations only"):
        run_config("colocated:1", RunOptions(), prof, None, [(0.0, a, 2)])


def test_swap_preemption_keeps_progress_and_charges_the_swap():
    from kvxfer.serving.engine.block_manager import BlockManager
    from kvxfer.serving.engine.config import EngineConfig
    from kvxfer.serving.engine.scheduler import Scheduler
    from kvxfer.serving.engine.sequence import Sequence, SequenceStatus

    cfg = EngineConfig(num_blocks=4, block_size=4, max_num_batched_tokens=64, preemption="swap")
    bm = BlockManager(4, 4)
    sched = Scheduler(cfg, bm)
    a, b = Sequence(range(7)), Sequence(range(50, 57))
    for s in (a, b):
        sched.add(s)
    for _ in range(2):  # prefill, then a decode at position 7
        chunks, _ = sched.schedule()
        for c in chunks:
            c.seq.num_computed_tokens = c.start + c.num_tokens
            bm.cache_full_blocks(c.seq)
            c.seq.token_ids.append(1)
            c.seq.status = SequenceStatus.DECODING
    chunks, _ = sched.schedule()  # both need a third block, none free: b is swapped out
    assert [c.seq for c in chunks] == [a] and b.status is SequenceStatus.SWAPPED
    assert list(sched.swapped) == [b] and not sched.waiting and sched.num_swap_blocks == 2
    sched.finish(a, "stop")
    chunks, _ = sched.schedule()  # back in, where it was: a decode, not a recompute
    assert [(c.seq, c.start, c.num_tokens) for c in chunks] == [(b, 8, 1)]
    assert sched.num_swap_blocks == 2 + 3
    bm.check_invariants()
    with pytest.raises(ValueError, match="preemption"):
        EngineConfig(preemption="drop")


# ---- the capacity search -------------------------------------------------------------
def _drive(gen, passes):
    try:
        k = next(gen)
        while True:
            k = gen.send(passes(k))
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("cap", [-100, -37, -3, 0, 1, 9, 40])
@pytest.mark.parametrize("guess", [-20, 0, 5, 60])
def test_capacity_probes_find_the_highest_passing_grid_point(cap, guess):
    probed = []

    def passes(k):
        probed.append(k)
        return k <= cap

    assert _drive(capacity_probes(guess), passes) == cap
    assert len(probed) == len(set(probed)) and len(probed) <= 2 * abs(cap - guess).bit_length() + 3
    assert _drive(capacity_probes(guess), lambda k: False) is None
    assert _drive(capacity_probes(guess, threshold=cap + 1), lambda k: k <= cap) is None
    assert _drive(capacity_probes(guess, threshold=cap), lambda k: k <= cap) == cap
    assert grid_index(grid_rate(cap)) == cap and grid_index(grid_rate(cap) * 1.049) == cap
    assert K_MIN == -100


def test_branch_and_bound_picks_what_the_exhaustive_search_picks():
    rng = random.Random(7)
    prof = load_profile("a100-opt13b-vllm")
    requests = TraceSlice(SHAREGPT, max_requests=50).arrivals()
    for trial in range(30):
        caps = {}
        names = placements(8, (1, 2, 4))

        def probe(self, job):  # a monotone stand-in for the virtual clock
            return {"passed": job[1] <= caps[job[0]]}

        for n in names:
            caps[n] = rng.choice([None, rng.randint(-40, 30)]) if rng.random() < 0.3 else rng.randint(-40, 30)
            caps[n] = K_MIN - 1 if caps[n] is None else caps[n]
        picks, runs = {}, {}
        for exhaustive in (False, True):
            spec = PlanSpec(gpus=8, slo=SLO(1000, 100), tps=(1, 2, 4), exhaustive=exhaustive,
                            variants=0)
            planner = Planner(spec, prof, RunOptions(chunked_prefill=False), requests)
            planner.probe = probe.__get__(planner)
            doc = planner.plan()
            picks[exhaustive], runs[exhaustive] = (doc["best"], doc["best_per_gpu_rate_rps"]), doc["runs"]
        top = max(caps.values())
        winners = sorted((n for n in names if caps[n] == top), key=lambda n: (gpus_of(n), names.index(n)))
        assert picks[True] == picks[False] == (winners[0], grid_rate(top)), trial
        assert runs[False] < runs[True]


def test_the_watch_stops_exactly_the_runs_that_miss_the_target():
    prof = load_profile("a100-opt13b-distserve")
    base = TraceSlice(SHAREGPT, max_requests=120, time_scale=0.2).arrivals()
    slo = SLO(200, 60)
    for name in ("1P1D@2,1", "1P1D"):
        full = run_config(name, RunOptions(chunked_prefill=False), prof, slo, base)
        for mode in ("both", "each"):
            att = attainment(full["records"], slo, mode)
            for target in (att - 0.02, att, att + 1e-6, att + 0.05):
                if not 0 < target <= 1:
                    continue
                watch = SLOWatch(slo, mode, target, len(base))
                row = run_config(name, RunOptions(chunked_prefill=False), prof, slo, base, watch=watch)
                assert bool(row.get("stopped")) == (att < target - 1e-12), (name, mode, target)
        both = summarize_run(full["records"], slo)["slo_attainment"]
        assert attainment(full["records"], slo, "both") == both
        assert attainment(full["records"], slo, "each") >= both


# ---- the CLI ----------------------------------------------------------------------------
def _kvxfer(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def test_plan_cli_pruned_and_exhaustive_agree_and_write_per_gpu_rates(tmp_path):
    common = ("plan", "--trace", SHAREGPT, "--max-requests", "150", "--profile", "a100-opt13b-vllm",
              "--slo", "400,60", "--gpus", "2", "--tp", "1,2", "--no-enable-chunked-prefill",
              "--jobs", "2", "--variants", "0")
    docs = {}
    for mode in ("pruned", "exhaustive"):
        out = tmp_path / f"{mode}.json"
        extra = ["--exhaustive"] if mode == "exhaustive" else ["--plot", tmp_path / "plots"]
        p = _kvxfer(*common, *extra, "--json", out)
        assert p.returncode == 0, p.stderr
        docs[mode] = json.loads(out.read_text())
    assert (tmp_path / "plots" / "attainment_vs_per_gpu_rate.png").stat().st_size > 0
    curves = docs["pruned"]["curves"]  # attainment against the rate per GPU, run to the end
    assert docs["pruned"]["best"] in curves and all(
        len(points) == 8 and all(0 <= p["attainment"] <= 1 for p in points) for points in curves.values())
    assert docs["pruned"]["best"] == docs["exhaustive"]["best"] is not None
    assert docs["pruned"]["runs"] < docs["exhaustive"]["runs"]
    full = {c["name"]: c for c in docs["exhaustive"]["configs"]}
    assert set(full) == set(placements(2, (1, 2)))
    for c in docs["pruned"]["configs"]:
        assert c["gpus"] == gpus_of(c["name"])
        if c["per_gpu_rate_rps"] is not None:  # searched in full: the same capacity
            assert c["per_gpu_rate_rps"] == full[c["name"]]["per_gpu_rate_rps"]
            assert c["max_rate_rps"] == pytest.approx(c["per_gpu_rate_rps"] * c["gpus"])
        else:
            assert c["pruned"] and (full[c["name"]]["per_gpu_rate_rps"] or 0) < c["below_per_gpu_rate_rps"] * 1.0001
    best = full[docs["exhaustive"]["best"]]
    assert docs["pruned"]["best_per_gpu_rate_rps"] == best["per_gpu_rate_rps"]
    bad = _kvxfer("plan", "--trace", SHAREGPT, "--profile", "a100-opt13b-vllm", "--slo", "400,60",
                  "--gpus", "4", "--tp", "1,3")
    assert bad.returncode != 0 and "has tensor-parallel degrees 1, 2, 4" in bad.stderr
    bad = _kvxfer("plan", "--trace", SHAREGPT, "--profile", "a100-opt13b-vllm", "--slo", "400,60",
                  "--gpus", "2", "--tp", "4")
    assert bad.returncode != 0 and "1..2 (--gpus)" in bad.stderr
