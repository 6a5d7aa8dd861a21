"""The step-time model: one linear form over a step's chunks, fitted to measured steps.

A step runs prompt chunks (``n`` tokens over a cached prefix of ``p`` tokens)
and one-token decode chunks (context ``c``: the tokens the new one attends to,
itself included). Its time is modelled as::

    t = a_prefill + b * sum(n) + c * sum(n * (p + n)) + d * batch + e * sum(ctx)
        [+ a_mixed when the step holds both]

with ``a_decode`` in place of ``a_prefill`` when the step holds no prompt
chunk. A prefill step without prefix is DistServe's ``a + b*sum(len) +
c*sum(len^2)`` and a decode step DistServe's ``a + e*sum(ctx) + d*batch``; a
mixed (chunked-prefill) step adds the decode chunks' terms to the prefill
form, and ``a_mixed``: what an engine pays once for running both kinds of
rows in one step (the embedded model passes each projection's weights once
for its prompt rows and once more for its one-token rows; an engine that
fuses them fits it near 0). One-token chunks count as decode chunks, as the
embedded model runs them on its batched decode path. A profile fitted before
``a_mixed`` existed reads it as 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

TERMS = ("a_prefill", "b_prefill_tokens", "c_prefill_attention", "a_decode", "d_decode_batch",
         "e_decode_context", "a_mixed")
OPTIONAL_TERMS = ("a_mixed",)  # 0 where a profile's fit lacks it (fitted before it existed)


def features(chunks: Iterable[tuple[int, int]]) -> tuple[float, ...]:
    """The model's regressors for one step; ``chunks`` are ``(num_tokens, start_pos)``."""
    tokens = attention = batch = context = 0
    for n, start in chunks:
        if n < 1 or start < 0:
            raise ValueError(f"a chunk needs num_tokens >= 1 and start >= 0, got ({n}, {start})")
        if n == 1:
            batch += 1
            context += start + 1
        else:
            tokens += n
            attention += n * (start + n)
    has_prompt = 1.0 if tokens else 0.0
    return (has_prompt, float(tokens), float(attention), 1.0 - has_prompt, float(batch),
            float(context), 1.0 if tokens and batch else 0.0)


@dataclass(frozen=True)
class StepCostModel:
    """Fitted coefficients, seconds per unit of each of :data:`TERMS`."""

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        coefs = tuple(self.coefficients)
        if len(coefs) != len(TERMS):
            raise ValueError(f"need {len(TERMS)} coefficients ({', '.join(TERMS)}), got {len(coefs)}")
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
               or v < 0 for v in coefs):
            raise ValueError(f"coefficients must be finite numbers >= 0, got {coefs}")
        object.__setattr__(self, "coefficients", tuple(float(v) for v in coefs))

    def step_seconds(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Modelled time of one step over ``(num_tokens, start_pos)`` chunks."""
        k, x = self.coefficients, features(chunks)  # the sum term by term, in TERMS order
        return (k[0] * x[0] + k[1] * x[1] + k[2] * x[2] + k[3] * x[3] + k[4] * x[4] + k[5] * x[5]
                + k[6] * x[6])

    def as_dict(self) -> dict:
        return dict(zip(TERMS, self.coefficients))

    @classmethod
    def from_dict(cls, raw: dict) -> "StepCostModel":
        missing = [t for t in TERMS if t not in raw and t not in OPTIONAL_TERMS]
        if missing:
            raise ValueError(f"cost model lacks {', '.join(missing)}")
        return cls(tuple(raw.get(t, 0.0) for t in TERMS))

    @classmethod
    def fit(cls, steps: Sequence[tuple[Sequence[tuple[int, int]], float]],
            terms: Sequence[str] = TERMS) -> "StepCostModel":
        """Least squares on relative error over ``(chunks, seconds)`` points, with every
        coefficient >= 0 (a term fitted negative is dropped and the rest refitted).

        Relative error, so a 20 ms decode step weighs as much as a 2 s prefill.
        Only ``terms`` are fitted; the others stay 0 (for data that cannot tell them)."""
        import numpy as np

        if len(steps) < len(TERMS):
            raise ValueError(f"need at least {len(TERMS)} measured steps, got {len(steps)}")
        x = np.array([features(chunks) for chunks, _ in steps])
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
        return cls(tuple(coefs))
