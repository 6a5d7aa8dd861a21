"""The P/D rebalancing decision policy (kvxfer.serving.server.adaptive_policy): a pure function."""
from __future__ import annotations

import pytest

from kvxfer.serving.server.adaptive_policy import (AdaptivePolicy, Move, Observation, PolicyState,
                                            changed, decide, wanted_move)

P = AdaptivePolicy(interval_s=1.0, min_dwell_s=10.0, sustain=3, prefill_queue_high=4,
                   prefill_queue_low=1, decode_active_high=8, decode_active_low=3)


def obs(now, num_prefill, num_decode, prefill_queue=0, decode_active=0, **kw):
    return Observation(now, num_prefill, num_decode, prefill_queue, decode_active, **kw)


def run(observations, state=PolicyState(), policy=P):
    """Feed the policy; every move is applied at once (as the router does after a drain)."""
    moves = []
    for o in observations:
        move, state = decide(o, state, policy)
        if move is not None:
            moves.append((o.now, move))
            state = changed(state, o.now)
    return moves, state


def test_prompt_heavy_moves_a_decode_worker_to_prefill_after_sustain():
    seq = [obs(t, 1, 2, prefill_queue=9, decode_active=1) for t in range(5)]
    moves, _ = run(seq)
    assert moves == [(2, Move("decode", "prefill", "prefill_queue"))]  # 3rd observation


def test_decode_heavy_moves_a_prefill_worker_to_decode():
    seq = [obs(t, 2, 1, prefill_queue=0, decode_active=12) for t in range(3)]
    assert run(seq)[0] == [(2, Move("prefill", "decode", "decode_batch"))]


def test_kv_pool_and_slo_signals():
    kv = obs(0, 2, 1, decode_active=1, kv_use=0.95)
    assert wanted_move(kv, P) == Move("prefill", "decode", "kv_pool")
    tpot = obs(0, 2, 1, decode_active=1, tpot_attainment=0.5, ttft_attainment=1.0)
    assert wanted_move(tpot, P) == Move("prefill", "decode", "tpot_slo")
    ttft = obs(0, 1, 2, prefill_queue=1, ttft_attainment=0.5, tpot_attainment=1.0)
    assert wanted_move(ttft, P) == Move("decode", "prefill", "ttft_slo")
    # the donor side missing its own SLO is not cool: nothing moves
    assert wanted_move(obs(0, 1, 2, prefill_queue=9, tpot_attainment=0.9), P) is None


def test_never_leaves_a_role_empty():
    assert wanted_move(obs(0, 1, 1, prefill_queue=50), P) is None
    assert wanted_move(obs(0, 1, 1, decode_active=50), P) is None
    assert wanted_move(obs(0, 3, 1, decode_active=50), P) == Move("prefill", "decode", "decode_batch")


def test_donor_must_stay_cool_after_losing_a_worker():
    # 2 decode workers with 5 active: 2.5 each is cool, 5 on one would not be
    assert wanted_move(obs(0, 1, 2, prefill_queue=9, decode_active=5), P) is None
    assert wanted_move(obs(0, 1, 2, prefill_queue=9, decode_active=3), P) is not None


def test_both_sides_hot_or_neither_moves_nothing():
    assert wanted_move(obs(0, 2, 2, prefill_queue=20, decode_active=40), P) is None
    assert wanted_move(obs(0, 2, 2, prefill_queue=4, decode_active=4), P) is None


def test_in_the_gap_between_thresholds_nothing_moves():
    # prefill 3 per worker: neither hot (>= 4) nor cool (<= 1)
    assert wanted_move(obs(0, 2, 2, prefill_queue=6, decode_active=40), P) is None


def test_streak_resets_when_the_wish_changes_or_stops():
    seq = [obs(0, 1, 2, prefill_queue=9), obs(1, 1, 2, prefill_queue=9), obs(2, 1, 2),
           obs(3, 1, 2, prefill_queue=9), obs(4, 1, 2, prefill_queue=9)]
    assert run(seq)[0] == []  # never 3 in a row
    moves, _ = run(seq + [obs(5, 1, 2, prefill_queue=9)])
    assert [t for t, _ in moves] == [5]


def test_no_flapping_when_the_mix_oscillates():
    """Load alternating every observation never moves a worker; a real shift moves one
    worker, and the reverse shift moves it back only after the dwell time."""
    seq = []
    for t in range(40):
        if t % 2:
            seq.append(obs(t, 2, 2, prefill_queue=10, decode_active=2))
        else:
            seq.append(obs(t, 2, 2, prefill_queue=0, decode_active=20))
    assert run(seq)[0] == []

    # a simulated 3-worker cluster whose counts follow the moves
    counts = {"prefill": 1, "decode": 2}
    state, moves = PolicyState(), []
    for t in range(40):
        load = (9, 1) if t < 3 else (0, 12)  # prompt-heavy, then decode-heavy
        move, state = decide(obs(t, counts["prefill"], counts["decode"], *load), state, P)
        if move is not None:
            counts[move.src] -= 1
            counts[move.dst] += 1
            moves.append((t, move))
            state = changed(state, t)
    assert moves == [(2, Move("decode", "prefill", "prefill_queue")),
                     (12, Move("prefill", "decode", "decode_batch"))]  # dwell 10 s after t=2
    assert counts == {"prefill": 1, "decode": 2}


def test_steady_after_a_move_does_not_undo_it():
    # after decode -> prefill, the same load seen with the new counts asks for nothing
    moves, state = run([obs(t, 1, 2, prefill_queue=9, decode_active=2) for t in range(3)])
    assert len(moves) == 1
    again, _ = run([obs(t, 2, 1, prefill_queue=9, decode_active=2) for t in range(3, 40)], state)
    assert again == []


def test_policy_validation():
    with pytest.raises(ValueError):
        AdaptivePolicy(prefill_queue_low=4, prefill_queue_high=4)  # no gap
    with pytest.raises(ValueError):
        AdaptivePolicy(sustain=0)
    with pytest.raises(ValueError):
        AdaptivePolicy(min_dwell_s=-1)


def test_serve_config_accepts_adaptive_only_where_a_worker_can_move():
    from kvxfer.serving.server.serve_config import ServeConfig

    policy = AdaptivePolicy()
    assert ServeConfig(num_prefill=1, num_decode=2, adaptive=policy).adaptive is policy
    for bad in (dict(num_prefill=1, num_decode=1), dict(num_colocated=3, num_prefill=0, num_decode=0),
                dict(discovery="static://127.0.0.1:9", num_prefill=0, num_decode=0)):
        with pytest.raises(ValueError):
            ServeConfig(adaptive=policy, **bad)
    with pytest.raises(ValueError):
        ServeConfig(retries=-1)


def test_requests_waiting_for_decode_blocks_are_decode_pressure():
    # 4 prefill, 2 decode workers: decode pools full of decoding requests, 12 requests
    # waiting for their blocks (no first token, but prefill has nothing to do for them)
    full = obs(0, 4, 2, prefill_queue=0, decode_active=6, kv_use=0.97, kv_reserved=0.05,
               admit_queue=12)
    assert wanted_move(full, P) == Move("prefill", "decode", "kv_admit")
    # counted as waiting for prefill (as before), prefill looks hot and nothing moves
    miscounted = obs(0, 4, 2, prefill_queue=12, decode_active=6, kv_use=0.97, kv_reserved=0.05)
    assert wanted_move(miscounted, P) is None
    # the admit queue alone makes decode hot, with a pool that is not yet 90% in use
    assert wanted_move(obs(0, 4, 2, decode_active=6, kv_use=0.8, admit_queue=2), P) == \
        Move("prefill", "decode", "kv_admit")
    # and a decode side with requests waiting for blocks is not cool: it gives no worker
    assert wanted_move(obs(0, 1, 3, prefill_queue=9, decode_active=3, admit_queue=2), P) is None


def test_blocks_reserved_for_prompts_waiting_for_prefill_are_prefill_backlog():
    # long prompts: decode pools 80% in use, nearly all by prompts still waiting for
    # prefill; few requests decode. Prefill is the bottleneck: decode gives a worker.
    backlog = obs(0, 4, 4, prefill_queue=20, decode_active=4, kv_use=0.8, kv_reserved=0.75)
    assert wanted_move(backlog, P) == Move("decode", "prefill", "prefill_queue")
    # the same use by decoding requests is decode's own: not cool, no move
    assert wanted_move(obs(0, 4, 4, prefill_queue=20, decode_active=4, kv_use=0.8), P) is None
    # requests waiting for blocks held by those prompts are prefill's backlog too
    stuck = obs(0, 4, 4, prefill_queue=2, decode_active=4, kv_use=0.98, kv_reserved=0.9,
                admit_queue=20)
    assert wanted_move(stuck, P) == Move("decode", "prefill", "prefill_queue")
    # ... but not once decoding requests hold most of the pool
    mostly_decoding = obs(0, 4, 4, prefill_queue=2, decode_active=4, kv_use=0.98,
                          kv_reserved=0.3, admit_queue=20)
    assert wanted_move(mostly_decoding, P) == Move("prefill", "decode", "kv_admit")


def test_admit_queue_thresholds_need_a_gap():
    with pytest.raises(ValueError):
        AdaptivePolicy(admit_queue_low=1.0, admit_queue_high=1.0)


def test_ttft_misses_while_requests_wait_for_decode_blocks_are_not_prefill_pressure():
    # TTFT attainment 30%: the requests missed it waiting for decode blocks, not prefill
    waiting = obs(0, 8, 8, prefill_queue=2, decode_active=60, kv_use=0.97, kv_reserved=0.05,
                  admit_queue=30, ttft_attainment=0.3, tpot_attainment=1.0)
    assert wanted_move(waiting, P) == Move("prefill", "decode", "kv_admit")
    # with no one waiting for decode blocks, the same misses are prefill's
    prefill_slow = obs(0, 2, 8, prefill_queue=2, decode_active=8, ttft_attainment=0.3,
                       tpot_attainment=1.0)
    assert wanted_move(prefill_slow, P) == Move("decode", "prefill", "ttft_slo")


def test_virtual_clock_observes_the_admit_queue_apart_from_the_prefill_queue(monkeypatch):
    """The virtual clock's observation: requests a decode worker cannot yet admit (its
    pool is full) are in ``admit_queue``, not ``prefill_queue``; ``kv_reserved`` is the
    part of ``kv_use`` that admitted prompts without a first token hold."""
    from kvxfer.sim import vclock
    from kvxfer.sim.configs import parse_config
    from kvxfer.serving.simulated.cost_model import StepCostModel
    from kvxfer.serving.simulated.link import Link
    from kvxfer.serving.simulated.profile import Profile

    seen = []

    def spy(o, state, policy):
        seen.append(o)
        return None, state

    monkeypatch.setattr(vclock, "decide", spy)
    profile = Profile(name="t", hardware="test box", model="m", dtype="fp32", block_size=16,
                      kv_bytes_per_token=1024,
                      fit=StepCostModel((0.01, 1e-4, 0.0, 0.005, 1e-4, 0.0, 0.0)),
                      link=Link(1e9, 1e-5), source="s", licence="MIT")
    # 2,048-token prompts (128 blocks) with long answers: a 300-block decode pool holds two
    arrivals = [(0.05 * i, list(range(i, i + 2048)), 200) for i in range(12)]
    config = parse_config("adaptive:1P2D", num_blocks=300)
    result = vclock.simulate(config, profile, arrivals)
    assert all(r["ok"] for r in result.records)
    assert seen and any(o.admit_queue > 0 for o in seen)
    for o in seen:
        assert o.prefill_queue >= 0 and 0 <= o.kv_reserved <= o.kv_use <= 1
    # at 1 s: 4 decoding (two a pool), the other 8 wait for blocks, none for prefill
    first = seen[0]
    assert (first.prefill_queue, first.admit_queue, first.decode_active) == (0, 8, 4)
    # later an admitted prompt waits for prefill, holding blocks of the decode pool
    assert any(o.prefill_queue > 0 and o.kv_reserved > 0 for o in seen)
