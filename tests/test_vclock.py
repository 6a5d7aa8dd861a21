"""The virtual clock (kvxfer simulate / kvxfer plan): configuration names, prompt ids,
modelled times, routing and rebalancing on the real serving classes, the CLIs' JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from kvxfer.loadgen.prompts import PromptBuilder
from kvxfer.loadgen.trace import TraceRequest
from kvxfer.serving.server.adaptive_policy import AdaptivePolicy
from kvxfer.sim.configs import ConfigError, configs_for, parse_config
from kvxfer.serving.simulated.cost_model import StepCostModel
from kvxfer.serving.simulated.link import Link
from kvxfer.serving.simulated.profile import Profile
from kvxfer.sim.vclock import prompt_hashes, simulate

FIT = StepCostModel((0.01, 1e-4, 0.0, 0.005, 1e-3, 1e-6, 0.0))  # a, b, c (prefill); a, d, e (decode); a_mixed
LINK = Link(1e9, 1e-5, "test")


def _profile(**kw) -> Profile:
    args = dict(name="t", hardware="test box", model="m", dtype="fp32", block_size=16,
                kv_bytes_per_token=1024, fit=FIT, link=LINK, source="s", licence="MIT")
    args.update(kw)
    return Profile(**args)


def _conversations(num_convs: int, turns: int, *, gap_s: float = 0.5, out: int = 8,
                   blocks_per_turn: int = 2, length_scale: float = 1 / 16):
    """Multi-turn chats: turn k of a conversation repeats its first k turns' hash ids."""
    builder = PromptBuilder(length_scale=length_scale)  # 32 ids a hash block
    arrivals = []
    for turn in range(turns):
        for c in range(num_convs):
            ids = tuple(1000 * c + i for i in range(blocks_per_turn * (turn + 1)))
            req = TraceRequest(0.0, len(ids) * 512 - 100, out * 16, ids)
            t = (turn * num_convs + c) * gap_s
            arrivals.append((t, builder.prompt_ids(req), builder.max_tokens(req)))
    return arrivals


# ---- configuration names ---------------------------------------------------------
def test_config_names_parse_to_serve_configs():
    c = parse_config("colocated:8")
    assert (c.num_colocated, c.num_prefill, c.num_decode) == (8, 0, 0) and not c.is_disaggregated
    c = parse_config("2P6D", num_blocks=64)
    assert (c.num_prefill, c.num_decode, c.num_blocks, c.local_prefill_queue) == (2, 6, 64, 0)
    c = parse_config("Conditional:2p6d")
    assert c.local_prefill_tokens > 0 and c.local_prefill_queue > 0
    c = parse_config("adaptive:1P2D", slo_ms=(2500.0, 150.0))
    assert c.adaptive is not None and c.adaptive_slo_ms == (2500.0, 150.0)


@pytest.mark.parametrize("name", ["colocated:0", "colocated:x", "3X", "0P2D", "2P0D",
                                  "mixed:2P2D", "colocated:2P2D", "adaptive:1P1D", "",
                                  "colocated:2@0", "1P1D@0", "1P1D@2,0", "1P1D@", "1P1D@1,2,3",
                                  "colocated:2@1,2"])
def test_bad_config_names_raise_config_error(name):
    with pytest.raises(ConfigError):
        parse_config(name)
    with pytest.raises(ValueError):  # ConfigError is a ValueError too
        parse_config(name)


def test_config_name_types_and_the_sweep():
    with pytest.raises(TypeError):
        parse_config(8)
    assert configs_for(1) == ["colocated:1"]
    assert configs_for(2) == ["colocated:2", "1P1D", "conditional:1P1D"]
    names = configs_for(16)
    assert len(names) == 1 + 3 * 15 and "adaptive:8P8D" in names and len(set(names)) == len(names)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            configs_for(bad)


# ---- prompts ---------------------------------------------------------------------
def test_prompt_ids_share_prefixes_as_hash_ids_do():
    pb = PromptBuilder(length_scale=0.1)  # 51 ids a hash block
    a = TraceRequest(0.0, 1400, 10, (5, 6, 7))
    b = TraceRequest(1.0, 1500, 10, (5, 6, 9))
    c = TraceRequest(2.0, 4000, 10, (5,))  # fewer ids than its length: padded, unique to it
    ia, ib, ic = pb.prompt_ids(a), pb.prompt_ids(b), pb.prompt_ids(c)
    assert (len(ia), len(ib), len(ic)) == (pb.num_words(a), pb.num_words(b), pb.num_words(c))
    assert ia[:102] == ib[:102] and ia[102] != ib[102]
    assert ic[:51] == ia[:51] and not set(ic[51:]) & set(ia) and len(set(ic)) == len(ic)
    assert PromptBuilder(length_scale=0.1).prompt_ids(a) == ia  # deterministic
    assert len(pb.prompt(a).split(" ")) == len(ia)  # as many ids as the text has words
    with pytest.raises(ValueError):
        pb.prompt_ids(TraceRequest(0.0, 10, 1, (1 << 40,)))


# ---- the event loop --------------------------------------------------------------
def test_every_request_gets_max_tokens_and_runs_are_deterministic():
    arrivals = _conversations(4, 3)
    for name in ("colocated:2", "1P1D", "conditional:1P2D", "adaptive:1P2D"):
        config = parse_config(name, num_blocks=256)
        res = simulate(config, _profile(), arrivals)
        assert len(res.records) == len(arrivals) and all(r["ok"] for r in res.records)
        want = sorted(m for _, _, m in arrivals)
        assert sorted(r["output_tokens"] for r in res.records) == want
        assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in res.records)
        assert simulate(config, _profile(), arrivals).records == res.records, name


def test_shared_prompt_hashes_give_the_same_runs():
    arrivals = _conversations(4, 3)
    hashes = prompt_hashes(arrivals, 16)
    assert [len(h) for h in hashes] == [len(ids) // 16 for _, ids, _ in arrivals]
    for name in ("colocated:2", "conditional:1P2D"):
        for routing in ("least-loaded", "kv"):
            config = parse_config(name, num_blocks=96)
            plain = simulate(config, _profile(), arrivals, routing=routing)
            shared = simulate(config, _profile(), arrivals, routing=routing, prompt_hashes=hashes)
            assert shared.records == plain.records and shared.counters == plain.counters
    with pytest.raises(ValueError, match="prompt hash"):
        simulate(parse_config("colocated:2"), _profile(), arrivals, prompt_hashes=hashes[1:])
    with pytest.raises(ValueError, match="prompt hashes"):
        simulate(parse_config("colocated:2"), _profile(), arrivals,
                 prompt_hashes=[h[:-1] for h in hashes])


def test_prompt_ids_that_are_not_plain_ints():
    """Numpy ids are made plain ints by a run that hashes its own prompts (the same run as
    plain ids); prompt_hashes refuses them, as a run given its hashes checks nothing."""
    import numpy as np

    arrivals = _conversations(3, 2)
    as_numpy = [(t, list(np.asarray(ids, dtype=np.int64)), m) for t, ids, m in arrivals]
    config = parse_config("1P1D", num_blocks=96)
    assert (simulate(config, _profile(), as_numpy).records
            == simulate(config, _profile(), arrivals).records)
    with pytest.raises(TypeError, match="request 0: prompt ids must be plain ints"):
        prompt_hashes(as_numpy, 16)


def test_least_loaded_runs_the_same_without_feeding_the_index():
    arrivals = _conversations(6, 4, gap_s=0.01, out=32)
    config = parse_config("conditional:1P3D", num_blocks=128)
    quiet = simulate(config, _profile(), arrivals, routed_hits=False)
    fed = simulate(config, _profile(), arrivals)  # events published: the router's hits counted
    routed = {k: fed.counters.pop(k) for k in ("routed_hit_blocks", "routed_prompt_blocks")}
    assert fed.records == quiet.records and fed.counters == quiet.counters
    assert quiet.counters["hit_tokens"] > 0 and routed["routed_hit_blocks"] > 0
    assert "routed_hit_blocks" not in quiet.counters
    # a policy that picks by prefix is fed whatever the caller asks
    kv = simulate(config, _profile(), arrivals, routing="kv", routed_hits=False)
    assert kv.counters["routed_hit_blocks"] > 0


def test_a_run_restores_the_collector_and_leaves_no_cycles():
    import gc

    arrivals = _conversations(3, 2)
    gc.collect()
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            simulate(parse_config("adaptive:1P2D", num_blocks=96), _profile(), arrivals, routing="kv")
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
        assert gc.collect() == 0  # all of it went by reference counting: the loop may skip gc


def test_the_virtual_clock_imports_no_torch():
    code = ("import sys; import kvxfer.sim.vclock, kvxfer.cli.plan, kvxfer.cli.simulate;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_arrivals_in_any_order_ties_by_index():
    arrivals = _conversations(4, 3)  # 12 requests, 0.5 s apart
    config = parse_config("conditional:1P2D", num_blocks=256)
    ordered = simulate(config, _profile(), arrivals).records
    shuffled = simulate(config, _profile(), arrivals[6:] + arrivals[:6]).records
    assert sorted(shuffled, key=lambda r: r["sent_s"]) == sorted(ordered, key=lambda r: r["sent_s"])
    short, long = list(range(3000, 3040)), list(range(4000, 4100))  # both at t=0: index order
    for first, second in ((short, long), (long, short)):
        recs = simulate(parse_config("colocated:2"), _profile(), [(0.0, first, 2), (0.0, second, 2)]).records
        assert {r["input_tokens"]: r["decode"] for r in recs} == {len(first): "colocated-0",
                                                                  len(second): "colocated-1"}


def test_modelled_times_of_one_disaggregated_request():
    prompt = list(range(1000, 1064))  # 64 tokens: 4 blocks, one prefill step
    res = simulate(parse_config("1P1D"), _profile(), [(0.0, prompt, 3)])
    (rec,) = res.records
    prefill_s = 0.01 + 1e-4 * 64  # a + b * tokens (c = 0)
    assert rec["ttft_s"] == pytest.approx(prefill_s)
    transfer_s = LINK.seconds(4 * 16 * 1024)  # the real model's bytes of 4 blocks
    assert rec["kv_transfer_ms"] == pytest.approx(transfer_s * 1e3)
    assert res.counters["kv_bytes"] == 4 * 16 * 1024
    decode_s = [0.005 + 1e-3 + 1e-6 * ctx for ctx in (65, 66)]  # a + d * batch + e * context
    assert rec["e2e_s"] == pytest.approx(prefill_s + transfer_s + sum(decode_s))
    assert rec["mode"] == "remote" and rec["prefill"] == "prefill-0"


def test_transfers_sharing_a_nic_queue_behind_each_other():
    prompts = [list(range(10_000 * k, 10_000 * k + 64)) for k in (1, 2)]
    slow = _profile(link=Link(1e6, 0.0, "slow"))  # 65 ms a transfer
    res = simulate(parse_config("1P1D"), slow, [(0.0, p, 2) for p in prompts])
    times = sorted(r["kv_transfer_ms"] for r in res.records)
    assert times[0] == pytest.approx(65.536) and times[1] > times[0] + 40  # waited on the egress


def test_workers_sharing_devices_step_at_their_share():
    # three colocated workers, one 64-token prompt each at t=0: one prefill step apiece
    prompts = [list(range(10_000 * k, 10_000 * k + 64)) for k in (1, 2, 3)]
    arrivals = [(0.0, p, 1) for p in prompts]
    prefill_s = 0.01 + 1e-4 * 64
    for devices, stretch in ((None, 1.0), (3, 1.0), (2, 1.5), (1, 3.0)):
        config = parse_config("colocated:3", **({} if devices is None else dict(
            engine="sim", profile="t", sim_devices=devices)))
        res = simulate(config, _profile(), arrivals)
        assert [r["ttft_s"] for r in res.records] == pytest.approx([prefill_s * stretch] * 3)
    # one device, the second prompt arriving halfway through the first's prefill on the
    # other worker: the first runs half alone, then both at half speed until it ends at
    # 1.5x; the second, half done by then, ends alone at 2x
    config = parse_config("colocated:2", engine="sim", profile="t", sim_devices=1)
    res = simulate(config, _profile(), [(0.0, prompts[0], 1), (prefill_s / 2, prompts[1], 1)])
    first, second = sorted(res.records, key=lambda r: r["sent_s"])
    assert first["ttft_s"] == pytest.approx(1.5 * prefill_s)
    assert second["ttft_s"] == pytest.approx(1.5 * prefill_s)
    assert second["sent_s"] + second["ttft_s"] == pytest.approx(2 * prefill_s)
    with pytest.raises(ConfigError):
        parse_config("1P1D", engine="sim", profile="t", sim_devices=0)


def test_a_request_longer_than_a_pool_is_refused_not_stuck():
    long_prompt = list(range(5000, 5000 + 40 * 16))
    res = simulate(parse_config("1P1D", num_blocks=32), _profile(),
                   [(0.0, long_prompt, 4), (0.1, list(range(64)), 4)])
    bad = [r for r in res.records if not r["ok"]]
    assert len(bad) == 1 and "KV pool" in bad[0]["error"] and res.counters["rejected_too_long"] == 1
    assert sum(r["ok"] for r in res.records) == 1


def test_kv_routing_follows_cached_prefixes():
    # requests overlap, so least-loaded spreads a conversation's turns over the workers
    # (a turn comes 0.12 s after the previous one, about when that one ends)
    arrivals = _conversations(6, 4, gap_s=0.02, out=32)  # 6 chats over 4 workers
    config = parse_config("colocated:4", num_blocks=512)
    ratios = {}
    for routing in ("least-loaded", "kv"):
        c = simulate(config, _profile(), arrivals, routing=routing).counters
        ratios[routing] = c["hit_tokens"] / c["query_tokens"]
    assert ratios["kv"] >= 2 * ratios["least-loaded"] and ratios["kv"] > 0.5, ratios


def test_kv_routing_gives_way_to_load():
    # every request shares one prefix; arriving at once, they would pile on one worker
    arrivals = _conversations(1, 1, out=4) * 12
    arrivals = [(0.001 * i, ids, m) for i, (_, ids, m) in enumerate(arrivals)]
    res = simulate(parse_config("colocated:4", num_blocks=512), _profile(), arrivals,
                   routing="kv", load_gap=2)
    assert len({r["decode"] for r in res.records}) >= 3


def test_adaptive_moves_a_worker_when_the_mix_shifts():
    # long prompts with one token each: the prefill side is the bottleneck
    pb = PromptBuilder(length_scale=1.0)
    arrivals = [(0.05 * i, pb.prompt_ids(TraceRequest(0.0, 1000, 1, (50_000 + i,))), 1)
                for i in range(200)]
    # decode pools big enough to stay cool while they hold the admitted requests' blocks
    res = simulate(parse_config("adaptive:1P3D", num_blocks=4096), _profile(), arrivals)
    assert res.counters.get("move_decode_to_prefill", 0) >= 1 and res.counters["role_changes"] >= 1
    static = simulate(parse_config("1P3D", num_blocks=4096), _profile(), arrivals)
    assert static.counters.get("role_changes", 0) == 0
    p50 = sorted(r["ttft_s"] for r in res.records)[100]
    assert p50 < sorted(r["ttft_s"] for r in static.records)[100]
    # the rebalancer's own policy: looking every 1,000 s it never looks within the run
    slow = AdaptivePolicy(interval_s=1000.0)
    late = simulate(parse_config("adaptive:1P3D", num_blocks=4096, adaptive=slow), _profile(),
                    arrivals)
    assert late.counters.get("role_changes", 0) == 0
    assert parse_config("adaptive:1P3D", adaptive=slow).adaptive is slow
    assert parse_config("adaptive:1P3D").adaptive == AdaptivePolicy()
    with pytest.raises(TypeError):
        parse_config("adaptive:1P3D", adaptive={"interval_s": 1000.0})


def _moving_mix():
    """Long prompts (prefill hot), then long answers (decode hot), then short chats:
    adaptive:2P2D moves workers both ways while prompts queue for decode blocks."""
    mix = _shifting_mix()
    mix += [(10 + 0.02 * i, ids, 64) for i, (_, ids, _) in enumerate(_shifting_mix())]
    return mix + [(12 + t, ids, m) for t, ids, m in _conversations(4, 3, gap_s=0.05, out=32)]


def _moving_config():
    return replace(parse_config("adaptive:2P2D", num_blocks=256), local_prefill_tokens=600,
                   local_prefill_queue=4)


def test_a_prompt_whose_prefill_worker_moved_meanwhile_is_not_lost():
    """A prompt waiting for decode blocks was routed to a prefill worker that the
    rebalancer has since moved to decode: it goes to a prefill worker (as the
    dispatcher's ``usable``), not to that one (whose decode path took its token, leaving
    the decode side's blocks held forever and the run stuck)."""
    res = simulate(_moving_config(), _profile(), _moving_mix())
    assert res.counters["move_prefill_to_decode"] >= 1 and res.counters["move_decode_to_prefill"] >= 1
    assert len(res.records) == len(_moving_mix()) and all(r["ok"] for r in res.records)


def test_a_stuck_adaptive_run_ends_with_an_error_not_a_hang():
    """With nothing left to happen but the rebalancer's looks, the run ends and says
    which requests are stuck (its looks no longer keep the clock going)."""
    config = parse_config("adaptive:1P2D", num_blocks=96)
    arrivals = _conversations(2, 2)
    from kvxfer.sim.vclock import VirtualCluster

    class Lossy(VirtualCluster):  # loses every landing: the decode side waits forever
        def _landed(self, r, token):
            pass

    with pytest.raises(RuntimeError, match="requests unfinished"):
        Lossy(config, _profile()).run(arrivals)


def test_the_rebalancers_counts_match_a_recount():
    """What _observe keeps count of as requests move (prompts without their first token,
    the decode blocks held for them) equals a recount over every unfinished request, at
    every look of a run that admits remotely, prefills locally and moves workers."""
    from kvxfer.sim.vclock import VirtualCluster

    looks = []

    class Recounting(VirtualCluster):
        def _observe(self):
            waiting = [r for r in self.requests.values() if not r.token_times]
            serving = {w for w in self.role("decode") if not w.is_switching}
            reserved = sum(len(seq.block_table) for r in waiting if r.decode in serving
                           for seq in (r.decode.seqs.get(r.rid),) if seq is not None)
            kept = self._reserved_blocks([w for w in self.workers if w in serving])
            looks.append((self.num_waiting, kept, len(waiting), reserved))
            super()._observe()

    res = Recounting(_moving_config(), _profile()).run(_moving_mix())
    assert len(res.records) == len(_moving_mix()) and res.counters["role_changes"] >= 1
    assert res.counters.get("local_prefill_tokens", 0) >= 1
    assert any(r for _, _, _, r in looks) and any(n for n, _, _, _ in looks)
    assert all(n == n2 and k == r for n, k, n2, r in looks)


def _shifting_mix():
    pb = PromptBuilder(length_scale=1.0)  # long prompts, one token each: prefill is short
    return [(0.05 * i, pb.prompt_ids(TraceRequest(0.0, 1000, 1, (50_000 + i,))), 1)
            for i in range(200)]


@pytest.mark.parametrize("arrivals, moves", [(_conversations(4, 3), False), (_shifting_mix(), True)])
def test_a_static_run_answers_for_its_adaptive_twin_until_it_would_move(arrivals, moves):
    static, adaptive = (parse_config(n, num_blocks=4096, slo_ms=(2500.0, 150.0))
                        for n in ("1P3D", "adaptive:1P3D"))
    plain = simulate(static, _profile(), arrivals)
    watched = simulate(static, _profile(), arrivals, twin=adaptive)
    assert watched.records == plain.records and watched.counters == plain.counters
    assert watched.end_s == plain.end_s
    real = simulate(adaptive, _profile(), arrivals)
    assert (real.counters.get("role_changes", 0) > 0) is moves
    if moves:
        assert watched.twin_end_s is None
    else:
        assert watched.twin_end_s == real.end_s > plain.end_s  # its last look: after the last request
        assert real.records == plain.records and real.counters == plain.counters
    with pytest.raises(ValueError, match="twin"):
        simulate(static, _profile(), arrivals, twin=parse_config("adaptive:2P2D", num_blocks=4096))


# ---- the CLIs ----------------------------------------------------------------------
@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    with open(path, "w") as f:
        for i in range(24):
            f.write(json.dumps({"timestamp": 400 * i, "input_length": 900 + 37 * i,
                                "output_length": 40, "hash_ids": [i % 3, 100 + i]}) + "\n")
    return path


def _kvxfer(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def test_simulate_cli_writes_the_json_schema(trace, tmp_path):
    out = tmp_path / "s.json"
    p = _kvxfer("simulate", "--trace", trace, "--profile", "cpu-smollm2", "--length-scale", "0.1",
                "--config", "colocated:2", "--config", "1P1D", "--slo", "5000,400",
                "--num-blocks", "128", "--json", out)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert [c["name"] for c in doc["configs"]] == ["colocated:2", "1P1D"]
    assert doc["best"] == max(doc["configs"], key=lambda c: c["goodput_rps"])["name"]
    for c in doc["configs"]:
        assert 0 <= c["slo_attainment"] <= 1 and c["goodput_rps"] >= 0
        assert len(c["records"]) == 24
    bad = _kvxfer("simulate", "--trace", trace, "--profile", "cpu-smollm2", "--config", "9Q")
    assert bad.returncode != 0 and "unknown configuration" in bad.stderr
    missing = _kvxfer("simulate", "--trace", tmp_path / "nope.jsonl", "--profile", "cpu-smollm2",
                      "--config", "1P1D")
    assert missing.returncode != 0 and "cannot read trace" in missing.stderr
    still = _kvxfer("simulate", "--trace", trace, "--profile", "cpu-smollm2", "--config",
                    "adaptive:1P2D", "--adaptive-interval", "0")
    assert still.returncode != 0 and "interval_s must be > 0" in still.stderr


def test_simulate_reads_the_slice_as_loadgen_does(trace):
    from kvxfer.sim.replay import TraceSlice

    base = dict(path=str(trace), start=2, max_requests=10, time_scale=0.5, length_scale=0.1,
                output_scale=0.5, jitter_ms=0.0, seed=0)

    def arrivals(kw):
        return TraceSlice(**kw).arrivals()

    plain = arrivals(base)
    assert [t for t, _, _ in plain] == pytest.approx([0.2 * i for i in range(10)])  # 400 ms, x0.5
    assert all(m == 20 for _, _, m in plain)  # 40 output tokens x0.5
    spread = arrivals({**base, "jitter_ms": 300.0, "seed": 1})
    times = [t for t, _, _ in spread]
    assert times == sorted(times) and times != [t for t, _, _ in plain]
    assert all(0 <= a - b < 0.15 for a, b in zip(times, [t for t, _, _ in plain]))
    assert arrivals({**base, "jitter_ms": 300.0, "seed": 1}) == spread


def test_the_table_prints_without_rich(monkeypatch, capsys):
    from kvxfer.cli.simulate import print_rows

    monkeypatch.setitem(sys.modules, "rich", None)  # rich is in the bench extra only
    row = {"name": "colocated:2", "goodput_rps": 1.5, "slo_attainment": 0.75,
           "request_throughput": 2.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 900.0,
           "tpot_p50_ms": 5.0, "tpot_p99_ms": 9.0, "prefix_hit_ratio": 0.25}
    print_rows("title", [row], "colocated:2")
    out = capsys.readouterr().out
    assert "colocated:2 *" in out and "1.500" in out and "75.0" in out and "best: colocated:2" in out
