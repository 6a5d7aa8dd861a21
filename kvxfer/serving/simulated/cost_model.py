"""The step-time model: one linear form over a step's chunks, fitted to measured steps.

A step runs prompt chunks (``n`` tokens over a cached prefix of ``p`` tokens)
and one-token decode chunks (context ``c``: the tokens the new one attends to,
itself included). Its time is modelled as::

    t = a_prefill + b * sum(n) + c * sum(attn(n, p)) + d * batch + e * sum(ctx)
        [+ a_mixed when the step holds both]

with ``a_decode`` in place of ``a_prefill`` when the step holds no prompt
chunk. ``attn(n, p)`` is the chunk's attention work in token pairs, in one of two
forms (:attr:`StepCostModel.attention`): ``"masked"`` ``n * (p + n)``, the masked
square an engine computes when it scores every pair and masks the future (the
embedded model's prefix path, and every profile fitted before the form was named),
or ``"causal"`` ``n * (p + n / 2)``, the pairs a causal kernel computes
(FlashAttention, DistServe's and vLLM's GPU kernels). Without prefix both are
``n^2`` up to a factor: a prefill step is DistServe's ``a + b*sum(len) +
c*sum(len^2)`` (``c`` DistServe's with ``"masked"``, twice it with ``"causal"``)
and a decode step DistServe's ``a + e*sum(ctx) + d*batch``.

A mixed (chunked-prefill) step adds the decode chunks' terms to the prefill
form, and ``a_mixed``: what an engine pays once for running both kinds of rows
in one step (the embedded model passes each projection's weights once for its
prompt rows and once more for its one-token rows; an engine that fuses them fits
it near 0). One-token chunks count as decode chunks, as the embedded model runs
them on its batched decode path. A profile fitted before ``a_mixed`` existed
reads it as 0.

DistServe fits decode twice, for small and large batches: :attr:`large_batch`
holds the large-batch ``(a_decode, d_decode_batch, e_decode_context)``, used by
a step of at least :attr:`large_batch_from` decode chunks (None: one fit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

TERMS = ("a_prefill", "b_prefill_tokens", "c_prefill_attention", "a_decode", "d_decode_batch",
         "e_decode_context", "a_mixed")
OPTIONAL_TERMS = ("a_mixed",)  # 0 where a profile's fit lacks it (fitted before it existed)
ATTENTION_FORMS = ("masked", "causal")
DECODE_TERMS = ("a_decode", "d_decode_batch", "e_decode_context")  # a large-batch fit's


def features(chunks: Iterable[tuple[int, int]], attention: str = "masked") -> tuple[float, ...]:
    """The model's regressors for one step; ``chunks`` are ``(num_tokens, start_pos)``;
    ``attention`` the form of the attention term (module docstring)."""
    causal = _causal(attention)
    tokens = pairs = batch = context = 0
    for n, start in chunks:
        if n < 1 or start < 0:
            raise ValueError(f"a chunk needs num_tokens >= 1 and start >= 0, got ({n}, {start})")
        if n == 1:
            batch += 1
            context += start + 1
        else:
            tokens += n
            pairs += n * (start + n / 2) if causal else n * (start + n)
    has_prompt = 1.0 if tokens else 0.0
    return (has_prompt, float(tokens), float(pairs), 1.0 - has_prompt, float(batch),
            float(context), 1.0 if tokens and batch else 0.0)


def _causal(attention: str) -> bool:
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention form must be one of {ATTENTION_FORMS}, got {attention!r}")
    return attention == "causal"


def _check(values, what: str) -> tuple[float, ...]:
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
           or v < 0 for v in values):
        raise ValueError(f"{what} must be finite numbers >= 0, got {tuple(values)}")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class StepCostModel:
    """Fitted coefficients, seconds per unit of each of :data:`TERMS`; the attention
    term's form; DistServe's large-batch decode fit where there is one (module docstring)."""

    coefficients: tuple[float, ...]
    attention: str = "masked"
    large_batch: tuple[float, float, float] | None = None  # DECODE_TERMS
    large_batch_from: int = 0  # decode chunks in a step from which large_batch applies

    def __post_init__(self) -> None:
        coefs = tuple(self.coefficients)
        if len(coefs) != len(TERMS):
            raise ValueError(f"need {len(TERMS)} coefficients ({', '.join(TERMS)}), got {len(coefs)}")
        object.__setattr__(self, "coefficients", _check(coefs, "coefficients"))
        _causal(self.attention)
        if self.large_batch is not None:
            if len(tuple(self.large_batch)) != len(DECODE_TERMS):
                raise ValueError(f"large_batch holds {', '.join(DECODE_TERMS)}")
            object.__setattr__(self, "large_batch", _check(self.large_batch, "large_batch"))
            if type(self.large_batch_from) is not int or self.large_batch_from < 1:
                raise ValueError(f"large_batch_from must be an int >= 1, got {self.large_batch_from!r}")
        elif self.large_batch_from:
            raise ValueError("large_batch_from without large_batch")

    def step_seconds(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Modelled time of one step over ``(num_tokens, start_pos)`` chunks."""
        # features() inlined: this runs once a step on the virtual clock
        causal = self.attention == "causal"
        tokens = pairs = batch = context = 0
        for n, start in chunks:
            if n == 1:
                batch += 1
                context += start + 1
            elif n > 1:
                tokens += n
                pairs += n * (start + n / 2) if causal else n * (start + n)
            else:
                raise ValueError(f"a chunk needs num_tokens >= 1, got {n}")
        k = self.coefficients
        a_decode, d, e = k[3], k[4], k[5]
        if self.large_batch is not None and batch >= self.large_batch_from:
            a_decode, d, e = self.large_batch
        t = d * batch + e * context
        if tokens:
            t += k[0] + k[1] * tokens + k[2] * pairs + (k[6] if batch else 0.0)
        elif batch:
            t += a_decode
        return t

    def as_dict(self) -> dict:
        out = dict(zip(TERMS, self.coefficients))
        if self.attention != "masked":
            out["attention"] = self.attention
        if self.large_batch is not None:
            out["large_batch"] = {"from_batch": self.large_batch_from,
                                  **dict(zip(DECODE_TERMS, self.large_batch))}
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "StepCostModel":
        missing = [t for t in TERMS if t not in raw and t not in OPTIONAL_TERMS]
        if missing:
            raise ValueError(f"cost model lacks {', '.join(missing)}")
        large, large_from = raw.get("large_batch"), 0
        if large is not None:
            try:
                large_from = large["from_batch"]
                large = tuple(large[t] for t in DECODE_TERMS)
            except (KeyError, TypeError):
                raise ValueError(f"large_batch holds from_batch and {', '.join(DECODE_TERMS)}, "
                                 f"got {large!r}") from None
        return cls(tuple(raw.get(t, 0.0) for t in TERMS), raw.get("attention", "masked"),
                   large, large_from)

    @classmethod
    def fit(cls, steps: Sequence[tuple[Sequence[tuple[int, int]], float]],
            terms: Sequence[str] = TERMS, attention: str = "masked") -> "StepCostModel":
        """Least squares on relative error over ``(chunks, seconds)`` points, with every
        coefficient >= 0 (a term fitted negative is dropped and the rest refitted).

        Relative error, so a 20 ms decode step weighs as much as a 2 s prefill.
        Only ``terms`` are fitted; the others stay 0 (for data that cannot tell them)."""
        import numpy as np

        if len(steps) < len(TERMS):
            raise ValueError(f"need at least {len(TERMS)} measured steps, got {len(steps)}")
        x = np.array([features(chunks, attention) for chunks, _ in steps])
        y = np.array([float(t) for _, t in steps])
        if not np.all(y > 0):
            raise ValueError("measured step times must be > 0")
        xw, yw = x / y[:, None], np.ones_like(y)
        unknown = set(terms) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown terms {sorted(unknown)}; terms are {TERMS}")
        active = [i for i, t in enumerate(TERMS) if t in terms and np.any(x[:, i])]
        while True:
            sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
            if np.all(sol >= 0):
                break
            del active[int(np.argmin(sol))]
        coefs = [0.0] * len(TERMS)
        for i, v in zip(active, sol):
            coefs[i] = float(v)
        return cls(tuple(coefs), attention)
