"""The simulated engine core: the real scheduler and block manager, a modelled forward.

:class:`SimRuntime` is a :class:`kvxfer.serving.engine.runtime.Runtime` whose
forward pass sleeps for the profile's modelled step time
(:class:`~kvxfer.serving.simulated.cost_model.StepCostModel`) instead of running a model,
fills the prompt blocks of its scaled-down pool (:class:`~kvxfer.serving.simulated.pool.SimPool`)
and emits deterministic tokens. Everything around the step (scheduling,
prefix caching, preemption, the worker loops, kvxfer transfers) is the real
code. Its :attr:`nic` models the worker's link for transfer timing
(:mod:`kvxfer.serving.simulated.link`); its :attr:`devices`, where given, the devices it
shares with the server's other simulated workers (:mod:`kvxfer.serving.simulated.devices`).

Tokens: the next token is a function of the previous token and the position
only, in ``[TOKEN_BASE, TOKEN_BASE + TOKEN_RANGE)`` (ordinary ids of any
Llama-family vocabulary), never one of the request's stop ids; so output
lengths follow ``max_tokens`` and every mode gives the same answer. The
simulated engine has no logits: token log-probabilities are not produced.
"""
from __future__ import annotations

import time

from ..engine.block_manager import BlockManager
from ..engine.config import EngineConfig
from ..engine.runtime import Runtime
from ..engine.scheduler import ScheduledChunk, Scheduler
from ..engine.sequence import Sequence
from .devices import SharedDevices
from .link import NicQueue
from .pool import DEFAULT_KV_SCALE, SimPool
from .profile import Profile

TOKEN_BASE, TOKEN_RANGE = 256, 16000
# Host time between two steps that the device absorbs: a step that starts within this of
# the previous one's modelled end starts at that end, as a device that runs steps back to
# back while the host prepares the next (an engine overlapping its scheduling with the
# device). Longer gaps are idle time, not absorbed.
HOST_OVERLAP_S = 0.002


def next_token(previous: int, position: int, stop_ids=()) -> int:
    """The simulated engine's token after ``previous`` at ``position``."""
    token = TOKEN_BASE + (previous * 2654435761 + position * 40503) % TOKEN_RANGE
    while token in stop_ids:
        token = TOKEN_BASE + (token - TOKEN_BASE + 1) % TOKEN_RANGE
    return token


class SimRuntime(Runtime):
    def __init__(self, config: EngineConfig, profile: Profile,
                 kv_scale: float = DEFAULT_KV_SCALE, devices: SharedDevices | None = None) -> None:
        """``profile`` at the worker's tensor-parallel degree (:meth:`Profile.at_tp`)."""
        if config.block_size != profile.block_size:
            raise ValueError(f"the profile {profile.name!r} was fitted with block size "
                             f"{profile.block_size}, the engine uses {config.block_size}")
        self.profile = profile
        self.pool = SimPool(config.num_blocks, config.block_size, profile.block_bytes, kv_scale,
                            tag=f"sim-{profile.name}")
        super().__init__(None, config, cache=self.pool.cache)
        self.matmul_dtype = f"sim:{profile.name}"
        self.nic = NicQueue(profile.link.wide(profile.tp))  # its tp GPUs' links
        self.devices = devices  # None: a device of its own
        self.modelled_s = 0.0  # total modelled forward time
        self.overrun_s = 0.0  # time steps ran past their modelled end (host too slow)
        self.absorbed_s = 0.0  # host time between steps absorbed (HOST_OVERLAP_S)
        self._step_end = float("-inf")  # the previous step's modelled end (perf_counter)

    def transfer_bytes(self, num_blocks: int) -> int:
        """The real model's bytes for ``num_blocks`` blocks: what the modelled link carries."""
        return num_blocks * self.profile.block_bytes

    def _forward(self, chunks: list[ScheduledChunk]):
        began = start = time.perf_counter()
        if 0.0 <= began - self._step_end <= HOST_OVERLAP_S:  # back to back
            start = self._step_end
            self.absorbed_s += began - start
        seconds = self.profile.fit.step_seconds((c.num_tokens, c.start) for c in chunks)
        for c in chunks:
            seq = c.seq
            if c.start < seq.num_prompt_tokens:  # prompt KV: what a transfer carries
                end = min(c.start + c.num_tokens, seq.num_prompt_tokens)
                self.pool.fill(seq.token_ids[:seq.num_prompt_tokens], seq.block_table,
                               c.start // self.block_size, (end - 1) // self.block_size)
        self.modelled_s += seconds
        if self.devices is not None:
            self._step_end = self.devices.run(seconds, start)
        else:
            self._step_end = start + seconds
            left = self._step_end - time.perf_counter()
            if left > 0:
                time.sleep(left)
            else:
                self.overrun_s -= left

        def pick(row: int, seq: Sequence) -> tuple[int, None]:
            return next_token(seq.token_ids[-1], seq.num_tokens, seq.params.stop_token_ids), None

        return pick
