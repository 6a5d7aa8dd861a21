"""Sampling parameters and the per-row sampler (greedy, temperature, top-p, seed)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a sampler runs: the router and the virtual clock never do
    import torch

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy (argmax). ``top_p`` keeps the smallest set of
    tokens whose probability reaches ``top_p``. ``seed`` makes a request's
    sampling reproducible (its own ``torch.Generator``). Generation stops at
    ``max_tokens``, at EOS (unless ``ignore_eos``), at a token in
    ``stop_token_ids``, or when the text contains a ``stop`` string (which is
    cut from the output). ``logprobs``: None, or report each sampled token's
    log-probability and the ``logprobs`` most likely alternatives
    (:func:`token_logprobs`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty str")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        """The request's own generator (seeded, or from OS entropy); None when greedy."""
        if self.is_greedy:
            return None
        import torch

        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def sample_row(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """One token from ``logits`` ``[vocab]`` (fp32)."""
    import torch

    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly better tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))



def token_logprobs(logits: torch.Tensor, token: int, num_top: int) -> dict:
    """The log-probability of ``token`` and of the ``num_top`` most likely tokens.

    ``logits`` ``[vocab]``: the model's raw output for one position. The values
    are ``log_softmax(logits)`` in fp32, before temperature or top-p (as
    vLLM's default ``raw_logprobs``), so they describe the model, not the
    sampler. Returns ``{"logprob": float, "top": [[token_id, logprob], ...]}``
    (most likely first; JSON-ready, as the worker messages carry it).
    """
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if num_top:
        values, ids = torch.topk(logp, num_top)
        top = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]
    return {"logprob": float(logp[token]), "top": top}
