"""The colocated engine: requests in, tokens out, one step at a time.

It also exposes the pieces a disaggregated deployment needs: a prefill-only
call that keeps the prompt's blocks (:meth:`Engine.prefill`), and the decode
side's reserve/admit pair that lets KV arrive from elsewhere
(:meth:`Engine.reserve`, :meth:`Engine.admit_prefilled`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence as Seq

import torch

from ..model.attention import Chunk
from .block_manager import BlockManager, OutOfBlocks
from .config import EngineConfig
from ..model.detokenize import IncrementalDetokenizer
from .sampling import SamplingParams, sample
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvxfer.layout import KVLayout


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of a request, with the text it adds (may be empty)."""

    request_id: str
    token_id: int
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" (eos/stop string/stop id) or "length"


class Engine:
    """Example::

        engine = Engine(EngineConfig(num_blocks=128, num_threads=1))
        for ev in engine.stream(messages=[{"role": "user", "content": "Hi"}],
                                params=SamplingParams(temperature=0, max_tokens=32)):
            print(ev.text, end="")
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        from ..model.gguf_loader import load_weights, open_gguf, read_model_config
        from ..model.kv_cache import KVCache
        from ..model.model import LlamaModel
        from ..model.tokenizer import Tokenizer

        self.config = config = config if config is not None else EngineConfig()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        reader = open_gguf(config.model_path)
        self.model_config = read_model_config(reader)
        self.tokenizer = Tokenizer.from_gguf(reader)
        cache = KVCache(config.num_blocks, self.model_config.num_layers, config.block_size,
                        self.model_config.num_kv_heads, self.model_config.head_dim)
        self.model = LlamaModel(self.model_config, load_weights(reader, self.model_config), cache)
        self.kv_cache = cache
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self._seqs: dict[str, Sequence] = {}
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0}

    # ---- requests ---------------------------------------------------------
    def make_sequence(self, prompt: str | Seq[int] | None = None, params: SamplingParams | None = None,
                      *, messages: Seq[Mapping[str, Any]] | None = None,
                      request_id: str | None = None) -> Sequence:
        """A validated :class:`Sequence` for a text prompt, token ids, or chat messages."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(messages)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.model_config.vocab_size for t in ids):
                raise ValueError("prompt token ids out of vocabulary range")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        total = len(ids) + params.max_tokens
        if total > self.model_config.max_position:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"the context length {self.model_config.max_position}")
        if -(-total // self.config.block_size) > self.config.num_blocks:
            raise ValueError(f"prompt + max_tokens ({total} tokens) cannot fit in the KV pool "
                             f"({self.config.num_blocks} blocks of {self.config.block_size})")
        if request_id is not None and request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(ids, params, request_id)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        return seq

    def add_request(self, prompt: str | Seq[int] | None = None, params: SamplingParams | None = None,
                    *, messages: Seq[Mapping[str, Any]] | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Tokens come out of :meth:`step`."""
        seq = self.make_sequence(prompt, params, messages=messages, request_id=request_id)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks (no-op if already finished)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping ---------------------------------------------------------
    def run_chunks(self, chunks: Seq[Chunk], *,
                   on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run chunks straight through the model (no scheduling); logits ``[S, vocab]``."""
        return self.model.forward(chunks, on_layer_done=on_layer_done)

    def step(self) -> list[TokenEvent]:
        """Run one scheduled step; returns the tokens it produced."""
        scheduled, is_prefill = self.scheduler.schedule()
        if not scheduled:
            if self.scheduler.has_work():
                raise OutOfBlocks("no request can make progress with the free KV blocks")
            return []
        chunks = [Chunk(c.seq.token_ids[c.start:c.start + c.num_tokens], c.start, c.seq.block_table)
                  for c in scheduled]
        began = time.perf_counter()
        logits = self.model.forward(chunks)
        kind = "prefill" if is_prefill else "decode"
        self.stats[f"{kind}_s"] += time.perf_counter() - began
        self.stats[f"{kind}_tokens"] += sum(c.num_tokens for c in scheduled)
        return self._postprocess(scheduled, logits)

    def _postprocess(self, scheduled: list[ScheduledChunk], logits: torch.Tensor) -> list[TokenEvent]:
        ready, rows = [], []
        for i, c in enumerate(scheduled):
            c.seq.num_computed_tokens = c.start + c.num_tokens
            self.block_manager.cache_full_blocks(c.seq)
            if c.completes_prefill:
                ready.append(c.seq)
                rows.append(i)
        if not ready:
            return []
        tokens = sample(logits[rows], [s.params for s in ready], [s.generator for s in ready])
        return [self._append_token(seq, tok) for seq, tok in zip(ready, tokens)]

    def _append_token(self, seq: Sequence, token_id: int) -> TokenEvent:
        seq.token_ids.append(token_id)
        seq.status = SequenceStatus.DECODING
        params = seq.params
        reason = None
        if (token_id == self.tokenizer.eos_id and not params.ignore_eos) \
                or token_id in params.stop_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens:
            reason = "length"
        detok = seq.detokenizer
        ids = seq.output_token_ids
        if reason == "stop":
            ids = ids[:-1]  # the stop token adds no text
        text = detok.update(ids, final=reason is not None) if detok is not None else ""
        if detok is not None and detok.stopped:
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
        return TokenEvent(seq.request_id, token_id, text, reason is not None, reason)

    # ---- convenience ------------------------------------------------------
    def stream(self, prompt: str | Seq[int] | None = None, params: SamplingParams | None = None,
               *, messages: Seq[Mapping[str, Any]] | None = None) -> Iterator[TokenEvent]:
        """Add one request and yield its tokens as they come (other requests advance too)."""
        rid = self.add_request(prompt, params, messages=messages)
        while True:
            for ev in self.step():
                if ev.request_id == rid:
                    yield ev
                    if ev.finished:
                        return

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | None = None
                 ) -> list[list[int]]:
        """Run ``prompts`` together to completion; returns each one's output token ids."""
        rids = [self.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {r: [] for r in rids}
        while self.has_unfinished():
            for ev in self.step():
                out[ev.request_id].append(ev.token_id)
        return [out[r] for r in rids]

    # ---- disaggregation hooks ----------------------------------------------
    def prefill(self, seq: Sequence, *, on_layer_done: Callable[[int], None] | None = None) -> int:
        """Prefill side: allocate blocks (reusing cached prefix blocks), compute the
        rest of the prompt in one step, and return the first sampled token.

        The blocks stay held (``seq.block_table``) until :meth:`release`; the
        prompt's full blocks are registered for prefix reuse.
        """
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"prefill needs a fresh sequence, got {seq!r}")
        self.block_manager.allocate(seq)
        start = seq.num_computed_tokens
        logits = self.model.forward([Chunk(seq.token_ids[start:], start, seq.block_table)],
                                    on_layer_done=on_layer_done)
        seq.num_computed_tokens = seq.num_tokens
        seq.status = SequenceStatus.PREFILLING  # held, not scheduled
        self.block_manager.cache_full_blocks(seq)
        return sample(logits, [seq.params], [seq.generator])[0]

    def release(self, seq: Sequence) -> None:
        """Free blocks held by :meth:`prefill` or :meth:`reserve` (idempotent)."""
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED

    def reserve(self, seq: Sequence) -> list[int]:
        """Decode side: allocate blocks for ``seq``'s prompt, reusing cached prefix blocks.

        Returns the block ids whose KV must arrive from the prefill side:
        ``seq.block_table[seq.num_cached_tokens // block_size:]``. Raises
        :class:`OutOfBlocks` when the pool cannot hold the prompt.
        """
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"reserve needs a fresh sequence, got {seq!r}")
        self.block_manager.allocate(seq)
        seq.status = SequenceStatus.PREFILLING
        return seq.block_table[seq.num_cached_tokens // self.config.block_size:]

    def admit_prefilled(self, seq: Sequence, first_token_id: int) -> TokenEvent:
        """Decode side: the prompt's KV is in ``seq``'s blocks; append the first token
        (sampled by the prefill side) and decode the rest in later :meth:`step` s."""
        if seq.status is not SequenceStatus.PREFILLING or not seq.block_table:
            raise ValueError(f"admit_prefilled needs a reserved sequence, got {seq!r}")
        if not 0 <= int(first_token_id) < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token_id} out of vocabulary range")
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.DECODING
        self._seqs[seq.request_id] = seq
        self.scheduler.add_running(seq)
        return self._append_token(seq, int(first_token_id))

    def kv_layout(self) -> "KVLayout":
        """The KV pool as a :class:`kvxfer.KVLayout` (dims ``"N L 2 B H D"``)."""
        return self.kv_cache.kv_layout()
