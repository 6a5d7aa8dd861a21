"""Step scheduling: chunked prefill by token budget, decode by continuous batching.

Two policies (``EngineConfig.schedule``):

- ``"mixed"`` (default, as vLLM's chunked prefill): every step carries one
  token for each decoding sequence (up to ``max_num_seqs``) and fills the rest
  of the ``max_num_batched_tokens`` budget with prompt chunks, so a long
  prompt never stalls the running decodes for more than one step.
- ``"separate"``: a step is either a prefill step (prompt chunks, at most
  ``max_num_batched_tokens`` tokens; prefill goes first) or a decode step.
- ``"prefill-first"`` (vLLM's ``--no-enable-chunked-prefill``): as ``"separate"``,
  but a prefill step takes whole prompts, as many as fit ``max_num_batched_tokens``;
  it holds back every running decode. A prompt longer than the budget runs alone.

New requests join the running batch as soon as blocks allow. When a decode
cannot grow a sequence, the most recently admitted sequence is preempted: its
blocks are freed and it waits to be recomputed (cached prefix blocks may survive);
with ``EngineConfig.preemption == "swap"`` (DistServe's decode instance) it is
swapped out instead: it keeps its progress, waits in :attr:`Scheduler.swapped`, and
is swapped back in, before any new sequence is admitted, once its blocks fit.
:attr:`Scheduler.num_swap_blocks` counts the blocks moved each way (a simulated
engine charges their transfer time to the step).
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


class ScheduledChunk(NamedTuple):
    """Run ``seq.token_ids[start:start + num_tokens]`` this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def completes_prefill(self) -> bool:
        return self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # PREFILLING or DECODING, in admission order
        self.swapped: deque[Sequence] = deque()  # SWAPPED, oldest first
        self.num_preemptions = 0
        self.num_swap_blocks = 0  # blocks swapped out and in (its reader may reset it)

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"only waiting sequences can be added, got {seq!r}")
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Add a sequence whose prompt KV is already in its blocks (prefilled elsewhere)."""
        if seq.status is not SequenceStatus.DECODING or not seq.block_table:
            raise ValueError(f"only decoding sequences with blocks can run, got {seq!r}")
        self.running.append(seq)

    def add_allocated(self, seq: Sequence) -> None:
        """Add a sequence whose blocks are already allocated (prefix hits counted in
        ``num_computed_tokens``); its remaining prompt is prefilled by later steps."""
        if seq.status is not SequenceStatus.PREFILLING or not seq.block_table:
            raise ValueError(f"only prefilling sequences with blocks can be added, got {seq!r}")
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> tuple[list[ScheduledChunk], bool]:
        """The next step's chunks (decode chunks first) and whether any of them is a
        prompt chunk (empty if idle)."""
        if self.swapped:
            self._swap_in()
        if self.config.schedule == "mixed":
            decodes = self._schedule_decode()
            prefills = self._schedule_prefill(self.config.max_num_batched_tokens - len(decodes))
            return decodes + prefills, bool(prefills)
        chunks = self._schedule_prefill(self.config.max_num_batched_tokens,
                                        whole=self.config.schedule == "prefill-first")
        if chunks:
            return chunks, True
        return self._schedule_decode(), False

    def _schedule_prefill(self, budget: int, whole: bool = False) -> list[ScheduledChunk]:
        """Prompt chunks within ``budget`` tokens; ``whole``: a prompt is taken whole or not
        at all (alone in its step when longer than ``budget``)."""
        chunks = []
        for seq in self.running:
            if seq.status is SequenceStatus.PREFILLING and budget > 0:
                n = seq.num_tokens - seq.num_computed_tokens
                n = n if whole else min(n, budget)
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and not self.swapped):
            seq = self.waiting[0]
            if whole and chunks and seq.num_tokens - seq.num_computed_tokens > budget:
                break  # the next step takes it
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.PREFILLING
            self.running.append(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            if not whole:
                n = min(n, budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return chunks

    def _swap_in(self) -> None:
        """Swapped sequences back on the device, oldest first, while their blocks fit."""
        bm = self.block_manager
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not bm.can_allocate(seq):
                break
            self.swapped.popleft()
            bm.allocate(seq)
            seq.num_computed_tokens = len(seq.token_ids) - 1
            bm.cache_full_blocks(seq)
            seq.status = SequenceStatus.DECODING
            self.running.append(seq)
            self.num_swap_blocks += len(seq.block_table)

    def _schedule_decode(self) -> list[ScheduledChunk]:
        scheduled: list[Sequence] = []
        max_num_seqs, block_size = self.config.max_num_seqs, self.block_manager.block_size
        decoding = SequenceStatus.DECODING
        for seq in list(self.running):
            if len(scheduled) == max_num_seqs:
                break
            if seq.status is not decoding:
                continue
            if len(seq.block_table) * block_size >= len(seq.token_ids):  # no new block needed
                scheduled.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                victim = self._newest_decoding(exclude=scheduled)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        return [ScheduledChunk(s, len(s.token_ids) - 1, 1) for s in scheduled]

    def _newest_decoding(self, exclude: list[Sequence]) -> Sequence:
        for seq in reversed(self.running):
            if seq.status is SequenceStatus.DECODING and seq not in exclude:
                return seq
        raise AssertionError("a sequence being scheduled is always a candidate")

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it first in line for recomputation, or, swapping
        a decoding sequence, last in line to be swapped back in."""
        swap = self.config.preemption == "swap" and seq.status is SequenceStatus.DECODING
        if swap:
            self.num_swap_blocks += len(seq.block_table)
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        self.num_preemptions += 1
        if swap:
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and free its blocks (it may be running or waiting)."""
        if seq.block_table:
            self.block_manager.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
