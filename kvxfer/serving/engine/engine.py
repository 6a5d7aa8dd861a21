"""The in-process engine: text or ids in, tokens and text out, one step at a time.

It adds a tokenizer, request ids and incremental detokenization to the one
engine core, :class:`~kvxfer.serving.engine.runtime.Runtime`, which the worker
processes run too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence as Seq

import torch

from ..model.detokenize import IncrementalDetokenizer
from .block_manager import OutOfBlocks
from .config import EngineConfig
from .runtime import Runtime
from .sampling import SamplingParams
from .sequence import Sequence

if TYPE_CHECKING:
    from kvxfer import KVLayout


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of a request, with the text it adds (may be empty)."""

    request_id: str
    token_id: int
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" (eos/stop string/stop id) or "length"
    # SamplingParams.logprobs set: sampling.token_logprobs() of this position
    logprobs: dict | None = None


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
        self.model = LlamaModel(self.model_config, load_weights(reader, self.model_config), cache,
                                 matmul_dtype=config.matmul_dtype)
        self.kv_cache = cache
        self.runtime = Runtime(self.model, config)
        self.block_manager = self.runtime.blocks
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

    @property
    def scheduler(self):
        return self.runtime.scheduler

    # ---- stepping ---------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Run one scheduled step; returns the tokens it produced."""
        began = time.perf_counter()
        step = self.runtime.step()
        if not step.num_tokens:
            if self.scheduler.has_work():
                raise OutOfBlocks("no request can make progress with the free KV blocks")
            return []
        kind = "prefill" if step.is_prefill else "decode"
        self.stats[f"{kind}_s"] += time.perf_counter() - began
        self.stats[f"{kind}_tokens"] += step.num_tokens
        return [self._append_token(seq, tok, lp)
                for (seq, tok), lp in zip(step.produced, step.logprobs)]

    def _append_token(self, seq: Sequence, token_id: int, logprobs: dict | None) -> TokenEvent:
        seq.token_ids.append(token_id)
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
        return TokenEvent(seq.request_id, token_id, text, reason is not None, reason, logprobs)

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

    def kv_layout(self) -> "KVLayout":
        """The KV pool as a :class:`kvxfer.KVLayout` (dims ``"N L 2 B H D"``)."""
        return self.kv_cache.kv_layout()
