"""The one engine core: model replica, KV pool, block manager, scheduler, one step.

:class:`Runtime` runs a scheduled step and says which sequences produced a
token; its owner keeps the request lifecycle: the worker loops
(:mod:`kvxfer.serving.workers.decode`, :mod:`.prefill`) or the in-process
:class:`kvxfer.serving.engine.engine.Engine`. The pool is
``model.kv_cache.tensor`` ``[N, L, 2, B, H, D]``, the very tensor a worker's
:class:`kvxfer.Agent` registers.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

from .block_manager import BlockManager
from .config import EngineConfig
from .sampling import SamplingParams, sample_row, token_logprobs
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # the model is imported where it is built (load), not by the simulated engine
    from ..model.model import LlamaModel


def sampling_params(raw: dict) -> SamplingParams:
    """The router's parameter dict (:meth:`kvxfer.serving.server.api._SamplingFields.sampling`)."""
    return SamplingParams(temperature=float(raw.get("temperature", 1.0)),
                          top_p=float(raw.get("top_p", 1.0)),
                          max_tokens=int(raw.get("max_tokens", 16)),
                          stop_token_ids=tuple(int(t) for t in raw.get("stop_token_ids", ())),
                          seed=raw.get("seed"), ignore_eos=bool(raw.get("ignore_eos", False)),
                          logprobs=raw.get("logprobs"))


def finish_reason(seq: Sequence, token: int) -> str | None:
    """Why ``seq`` ends with ``token`` (already appended), or None to go on."""
    if token in seq.params.stop_token_ids and not seq.params.ignore_eos:
        return "stop"
    if seq.num_output_tokens >= seq.params.max_tokens:
        return "length"
    return None


class Step(NamedTuple):
    """What one :meth:`Runtime.step` did."""

    produced: list[tuple[Sequence, int]]  # (sequence, sampled token) per finished chunk
    is_prefill: bool
    num_tokens: int  # tokens run through the model
    # per produced entry: token_logprobs() when its params ask for logprobs, else None
    logprobs: list[dict | None] = []


def _timed_step(forward, chunks):
    """``forward(chunks)`` timed: ``(pick, spent)``, where ``spent[0]`` is the seconds of the
    forward pass plus every call of the returned ``pick`` so far (what the simulated engine
    stands in for: the step log's time; the scheduler's work around it is left out)."""
    clock = time.perf_counter
    began = clock()
    inner = forward(chunks)
    spent = [clock() - began]

    def pick(row, seq):
        began = clock()
        out = inner(row, seq)
        spent[0] += clock() - began
        return out

    return pick, spent


class Runtime:
    def __init__(self, model: "LlamaModel | None", config: EngineConfig, cache=None):
        """``cache``: the KV pool, by default ``model.kv_cache`` (the simulated engine has
        no model and passes its own; the virtual clock has neither: ``cache`` stays None)."""
        self.model = model
        self.config = config
        self.cache = cache if cache is not None or model is None else model.kv_cache
        # the projections' resolved dtype, reported in the worker's ``ready``
        self.matmul_dtype = model.matmul_dtype if model is not None else ""
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)

    nic = None  # the modelled NIC (kvxfer.serving.simulated.link.NicQueue) of a simulated engine; None: real
    # kvxfer.serving.engine.step_log.StepLog (or anything with its record()): each step's
    # chunks and the seconds of its forward pass and sampling; None: not recorded
    step_log = None

    @classmethod
    def load(cls, config: EngineConfig) -> "Runtime":
        from ..model.model import LlamaModel

        model = LlamaModel.from_gguf(config.model_path, num_blocks=config.num_blocks,
                                     block_size=config.block_size,
                                     matmul_dtype=config.matmul_dtype)
        return cls(model, config)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def step(self) -> Step:
        """Run the scheduler's next step: ``Step([(seq, sampled_token), ...], is_prefill, n,
        logprobs)``.

        A sequence appears only when its chunk reached its last token (prefill
        complete, or a decode token); the caller appends the token and decides
        whether it finishes. Full blocks are registered for prefix reuse as
        soon as their KV is in the pool.
        """
        chunks, is_prefill = self.scheduler.schedule()
        if not chunks:
            return Step([], False, 0)
        log = self.step_log
        if log is None:
            pick = self._forward(chunks)
        else:
            pick, model_s = _timed_step(self._forward, chunks)
        produced, logprobs = [], []
        cache_full_blocks, num_tokens = self.blocks.cache_full_blocks, 0
        block_size = self.blocks.block_size
        for row, c in enumerate(chunks):
            seq = c.seq
            seq.num_computed_tokens = computed = c.start + c.num_tokens
            num_tokens += c.num_tokens
            if computed // block_size > len(seq.block_hashes):  # a block filled: register it
                cache_full_blocks(seq)
            if computed == len(seq.token_ids):  # the chunk completes the prefill
                seq.status = SequenceStatus.DECODING
                token, token_lp = pick(row, seq)
                produced.append((seq, token))
                logprobs.append(token_lp)
        if log is not None:
            log.record([(c.num_tokens, c.start) for c in chunks], model_s[0])
        return Step(produced, is_prefill, num_tokens, logprobs)

    def _forward(self, chunks: list[ScheduledChunk]):
        """Run the model over ``chunks`` (writing their KV); returns ``pick(row, seq) ->
        (token, logprobs or None)`` that samples chunk ``row``'s next token."""
        from ..model.attention import Chunk

        logits = self.model.forward(
            [Chunk(tuple(c.seq.token_ids[c.start:c.start + c.num_tokens]), c.start,
                   tuple(c.seq.block_table)) for c in chunks])

        def pick(row: int, seq: Sequence) -> tuple[int, dict | None]:
            token = sample_row(logits[row], seq.params, seq.generator)
            num_top = seq.params.logprobs
            return token, None if num_top is None else token_logprobs(logits[row], token, num_top)

        return pick

    def release(self, seq: Sequence, reason: str = "abort") -> None:
        """Free ``seq``'s blocks, wherever it is (scheduler queues or held by the worker)."""
        sched = self.scheduler
        if seq in sched.running or seq in sched.waiting or seq in sched.swapped:
            self.scheduler.finish(seq, reason)
        elif seq.block_table:
            self.blocks.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
