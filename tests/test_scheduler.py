"""Scheduler: chunked prefill by token budget, continuous batching, preemption (no model)."""
from kvxfer.serving.engine.block_manager import BlockManager
from kvxfer.serving.engine.config import EngineConfig
from kvxfer.serving.engine.scheduler import Scheduler
from kvxfer.serving.engine.sequence import Sequence, SequenceStatus

import pytest

B = 4


def make(num_blocks=16, budget=8, max_seqs=4, schedule="mixed"):
    cfg = EngineConfig(num_blocks=num_blocks, block_size=B, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs, schedule=schedule)
    bm = BlockManager(num_blocks, B)
    return Scheduler(cfg, bm), bm


def run_step(sched, bm, next_token=7):
    """What the engine does after the model ran: advance, cache, append sampled tokens."""
    chunks, is_prefill = sched.schedule()
    for c in chunks:
        c.seq.num_computed_tokens = c.start + c.num_tokens
        bm.cache_full_blocks(c.seq)
        if c.completes_prefill:
            c.seq.token_ids.append(next_token)
            c.seq.status = SequenceStatus.DECODING
    return chunks, is_prefill


def test_prefill_is_chunked_by_token_budget():
    sched, bm = make(budget=8)
    a, b = Sequence(range(20)), Sequence(range(100, 103))
    sched.add(a)
    sched.add(b)
    chunks, is_prefill = run_step(sched, bm)
    assert is_prefill and [(c.seq, c.start, c.num_tokens) for c in chunks] == [(a, 0, 8)]
    chunks, _ = run_step(sched, bm)
    assert [(c.seq, c.start, c.num_tokens) for c in chunks] == [(a, 8, 8)]
    chunks, _ = run_step(sched, bm)  # a's last 4 tokens, then b fits in the rest of the budget
    assert [(c.seq, c.start, c.num_tokens) for c in chunks] == [(a, 16, 4), (b, 0, 3)]
    assert a.num_tokens == 21 and b.num_tokens == 4
    chunks, is_prefill = run_step(sched, bm)
    assert not is_prefill and [(c.seq, c.start, c.num_tokens) for c in chunks] == [(a, 20, 1), (b, 3, 1)]


def test_continuous_batching_admits_when_blocks_free():
    sched, bm = make(num_blocks=4, budget=64, schedule="separate")
    a, b = Sequence(range(8)), Sequence(range(50, 58))  # 2 blocks each (+1 for decode)
    c = Sequence(range(90, 96))
    for s in (a, b, c):
        sched.add(s)
    chunks, _ = run_step(sched, bm)
    assert [ch.seq for ch in chunks] == [a, b] and list(sched.waiting) == [c]
    sched.finish(a, "stop")
    assert bm.num_free_blocks == 2
    chunks, is_prefill = run_step(sched, bm)
    assert is_prefill and [ch.seq for ch in chunks] == [c]
    bm.check_invariants()


def test_preempts_newest_when_decode_runs_out_of_blocks():
    sched, bm = make(num_blocks=4, budget=64)
    a, b = Sequence(range(7)), Sequence(range(50, 57))  # 2 blocks each, 8 tokens after prefill
    sched.add(a)
    sched.add(b)
    run_step(sched, bm)
    chunks, is_prefill = run_step(sched, bm)  # positions 7 still fit
    assert not is_prefill and len(chunks) == 2
    for s in (a, b):
        s.token_ids.append(1)  # 9 tokens: each needs a third block, none free
    chunks, is_prefill = sched.schedule()
    assert not is_prefill and [ch.seq for ch in chunks] == [a]
    assert b.status is SequenceStatus.WAITING and list(sched.waiting) == [b]
    assert b.block_table == [] and sched.num_preemptions == 1
    assert len(a.block_table) == 3
    bm.check_invariants()


def test_max_num_seqs_limits_admission():
    sched, bm = make(num_blocks=64, budget=64, max_seqs=2)
    seqs = [Sequence(range(i * 10, i * 10 + 3)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    chunks, _ = run_step(sched, bm)
    assert [c.seq for c in chunks] == seqs[:2] and len(sched.waiting) == 1


def test_add_rejects_running_sequence():
    sched, _ = make()
    s = Sequence([1, 2])
    s.status = SequenceStatus.DECODING
    with pytest.raises(ValueError):
        sched.add(s)
    with pytest.raises(ValueError):
        sched.add_running(s)  # no blocks


def test_mixed_step_carries_decodes_and_prompt_chunks():
    sched, bm = make(num_blocks=32, budget=8)
    a = Sequence(range(5))
    sched.add(a)
    run_step(sched, bm)  # a prefilled, now decoding
    b = Sequence(range(100, 120))
    sched.add(b)
    chunks, is_prefill = run_step(sched, bm)  # a's decode token + 7 of b's prompt tokens
    assert is_prefill
    assert [(c.seq, c.start, c.num_tokens) for c in chunks] == [(a, 5, 1), (b, 0, 7)]
    chunks, _ = run_step(sched, bm)
    assert [(c.seq, c.start, c.num_tokens) for c in chunks] == [(a, 6, 1), (b, 7, 7)]
    chunks, _ = run_step(sched, bm)  # b's last 6 tokens complete its prompt
    assert [(c.seq, c.start, c.num_tokens) for c in chunks] == [(a, 7, 1), (b, 14, 6)]
    chunks, is_prefill = run_step(sched, bm)
    assert not is_prefill and [(c.seq, c.num_tokens) for c in chunks] == [(a, 1), (b, 1)]
    bm.check_invariants()


def test_separate_schedule_runs_prefill_steps_apart():
    sched, bm = make(num_blocks=32, budget=8, schedule="separate")
    a = Sequence(range(5))
    sched.add(a)
    run_step(sched, bm)
    b = Sequence(range(100, 110))
    sched.add(b)
    chunks, is_prefill = run_step(sched, bm)  # a waits while b's prompt runs
    assert is_prefill and [(c.seq, c.num_tokens) for c in chunks] == [(b, 8)]


def test_schedule_policy_is_validated():
    with pytest.raises(ValueError):
        EngineConfig(schedule="interleaved")


def test_sequence_takes_a_copy_of_plain_ints_and_converts_the_rest():
    import numpy as np

    prompt = [5, 6, 7]
    s = Sequence(prompt)
    s.token_ids.append(8)
    assert prompt == [5, 6, 7] and s.num_prompt_tokens == 3  # a copy, not the caller's list
    for given in (list(np.arange(5, 8)), (5, 6, 7), range(5, 8), [True, 6, 7]):
        s = Sequence(given)
        assert [type(t) for t in s.token_ids] == [int] * 3, given
        assert s.token_ids == ([1, 6, 7] if given[0] is True else [5, 6, 7])
    with pytest.raises(ValueError):
        Sequence([])


def test_prefill_first_takes_whole_prompts_and_holds_back_decodes():
    # vLLM without chunked prefill: whole prompts up to the budget, a longer one alone
    sched, bm = make(num_blocks=64, budget=8, schedule="prefill-first")
    a, b, c = Sequence(range(5)), Sequence(range(50, 54)), Sequence(range(100, 120))
    for s in (a, b, c):
        sched.add(s)
    chunks, is_prefill = run_step(sched, bm)
    assert is_prefill and [(ch.seq, ch.start, ch.num_tokens) for ch in chunks] == [(a, 0, 5)]
    chunks, is_prefill = run_step(sched, bm)  # b fits with nothing else; c (20 > 8) waits
    assert is_prefill and [(ch.seq, ch.num_tokens) for ch in chunks] == [(b, 4)]
    chunks, is_prefill = run_step(sched, bm)  # c alone, whole, past the budget; a and b wait
    assert is_prefill and [(ch.seq, ch.start, ch.num_tokens) for ch in chunks] == [(c, 0, 20)]
    chunks, is_prefill = run_step(sched, bm)
    assert not is_prefill and [ch.seq for ch in chunks] == [a, b, c]
    d = Sequence(range(200, 203))
    sched.add(d)  # a waiting prompt runs before every decode
    chunks, is_prefill = run_step(sched, bm)
    assert is_prefill and [ch.seq for ch in chunks] == [d]
    bm.check_invariants()
