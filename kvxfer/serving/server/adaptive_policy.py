"""When to move a worker between the prefill and decode roles: a pure decision policy.

``decide(obs, state, policy) -> (Move | None, state)`` looks at one
:class:`Observation` of the router (taken every ``policy.interval_s``) and the
:class:`PolicyState` it returned last time; it has no clock, no I/O and no
side effects, so a test can feed it any sequence of observations.

Pressure on each side (per worker of that role):

- prefill: requests waiting for their first token that hold their decode KV
  blocks (``prefill_queue``: queued for or in prefill, or their KV in flight),
  and, when an SLO is set, TTFT attainment over the recent window;
- decode: requests past their first token (``decode_active``), requests that
  wait for a decode worker's KV blocks before they can go to prefill
  (``admit_queue``: decode's shortage, not prefill's, though they have no first
  token either), the decode workers' KV pool use by requests past their first
  token (``kv_use`` less ``kv_reserved``, the share reserved for prompts still
  waiting for prefill: that is prefill's backlog, freed faster by more prefill),
  and, with an SLO, TPOT attainment. When prompts waiting for prefill hold most
  of the used decode blocks, the admit queue is prefill's backlog too and counts
  as prefill pressure; while it is decode's, TTFT misses (which include the wait
  for decode blocks) say nothing about prefill.

A side is *hot* when one of its signals crosses its high threshold and *cool*
when all of them are under their low thresholds; the gap between the two is
the first layer of hysteresis. A move from role A to role B needs B hot, A
cool, A to keep at least one worker (``num_A >= 2``: no role is ever left
empty), and A still cool after losing the worker (its per-worker load scaled
by ``num_A / (num_A - 1)``), which is what stops a move from undoing itself.
The same wish must hold ``policy.sustain`` observations in a row, and
``policy.min_dwell_s`` must have passed since the last role change (dwell).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class AdaptivePolicy:
    """Thresholds of :func:`decide` (``kvxfer serve --adaptive``, docs/serving.md)."""

    interval_s: float = 1.0  # how often the router observes
    min_dwell_s: float = 10.0  # no role change sooner than this after the previous one
    sustain: int = 3  # consecutive observations that must want the same move
    prefill_queue_high: float = 4.0  # waiting prompts per prefill worker: prefill is hot
    prefill_queue_low: float = 1.0  # ... at most this: prefill is cool
    decode_active_high: float = 8.0  # decoding requests per decode worker: decode is hot
    decode_active_low: float = 3.0
    kv_use_high: float = 0.9  # fraction of the decode workers' KV pools in use by decoding requests
    kv_use_low: float = 0.6
    admit_queue_high: float = 1.0  # requests waiting for decode KV blocks per decode worker: hot
    admit_queue_low: float = 0.0  # ... at most this: cool
    attainment_high: float = 0.95  # with an SLO: share of recent requests meeting it
    attainment_low: float = 0.8
    drain_timeout_s: float = 120.0  # a drain taking longer is abandoned (worker rejoins)

    def __post_init__(self) -> None:
        for name in ("interval_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.min_dwell_s < 0:
            raise ValueError("min_dwell_s must be >= 0")
        if self.sustain < 1:
            raise ValueError("sustain must be >= 1")
        for low, high in (("prefill_queue_low", "prefill_queue_high"),
                          ("decode_active_low", "decode_active_high"),
                          ("kv_use_low", "kv_use_high"), ("admit_queue_low", "admit_queue_high"),
                          ("attainment_low", "attainment_high")):
            if not 0 <= getattr(self, low) < getattr(self, high):
                raise ValueError(f"need 0 <= {low} < {high} (a gap between the thresholds)")


@dataclass(frozen=True)
class Observation:
    """What the router saw at time ``now`` (seconds, any monotonic origin).

    ``prefill_queue``/``decode_active``/``admit_queue`` are totals over the role's
    workers; a request without its first token is counted once, in ``admit_queue``
    while it waits for a decode worker's KV blocks, in ``prefill_queue`` after.
    ``kv_use``: the decode workers' KV pools in use (0..1), ``kv_reserved`` of it
    held by requests still without their first token. Attainments are None when
    no SLO is set or no request finished recently.
    """

    now: float
    num_prefill: int
    num_decode: int
    prefill_queue: int
    decode_active: int
    kv_use: float = 0.0
    admit_queue: int = 0
    kv_reserved: float = 0.0
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None


@dataclass(frozen=True)
class Move:
    """Move one worker ``src`` -> ``dst`` because of ``reason`` (a metric label)."""

    src: str
    dst: str
    reason: str


@dataclass(frozen=True)
class PolicyState:
    last_change_at: float | None = None  # ``Observation.now`` of the last role change
    wish: Move | None = None  # the move the last observations wanted
    streak: int = 0  # how many observations in a row wanted it


def _queues(obs: Observation) -> tuple[int, int]:
    """(prefill queue, admit queue) as pressure: the requests waiting for decode KV
    blocks are decode's when requests past their first token hold most of the used
    blocks, and prefill's backlog when prompts still waiting for prefill do."""
    reserved = obs.kv_reserved
    if obs.admit_queue and reserved > obs.kv_use - reserved:
        return obs.prefill_queue + obs.admit_queue, 0
    return obs.prefill_queue, obs.admit_queue


def _prefill_side(obs: Observation, p: AdaptivePolicy, workers: int) -> tuple[str | None, bool]:
    """(reason it is hot or None, is it cool) with ``workers`` prefill workers."""
    queue, admit = _queues(obs)
    queue /= max(workers, 1)
    # TTFT counts the wait for decode blocks: while requests wait there, misses are decode's
    att = obs.ttft_attainment if not admit else None
    if queue >= p.prefill_queue_high:
        hot = "prefill_queue"
    elif att is not None and att < p.attainment_low:
        hot = "ttft_slo"
    else:
        hot = None
    cool = queue <= p.prefill_queue_low and (att is None or att >= p.attainment_high)
    return hot, cool


def _decode_side(obs: Observation, p: AdaptivePolicy, workers: int) -> tuple[str | None, bool]:
    scale = obs.num_decode / max(workers, 1)
    active = obs.decode_active / max(workers, 1)
    admit = _queues(obs)[1] / max(workers, 1)
    kv_use = max(obs.kv_use - obs.kv_reserved, 0.0) * scale
    att = obs.tpot_attainment
    if active >= p.decode_active_high:
        hot = "decode_batch"
    elif admit >= p.admit_queue_high:
        hot = "kv_admit"
    elif kv_use >= p.kv_use_high:
        hot = "kv_pool"
    elif att is not None and att < p.attainment_low:
        hot = "tpot_slo"
    else:
        hot = None
    cool = (active <= p.decode_active_low and admit <= p.admit_queue_low
            and kv_use <= p.kv_use_low and (att is None or att >= p.attainment_high))
    return hot, cool


def wanted_move(obs: Observation, p: AdaptivePolicy) -> Move | None:
    """The move this observation alone asks for (no dwell, no sustain)."""
    prefill_hot, _ = _prefill_side(obs, p, obs.num_prefill)
    decode_hot, _ = _decode_side(obs, p, obs.num_decode)
    if prefill_hot and not decode_hot and obs.num_decode >= 2:
        _, still_cool = _decode_side(obs, p, obs.num_decode - 1)
        if still_cool:
            return Move("decode", "prefill", prefill_hot)
    if decode_hot and not prefill_hot and obs.num_prefill >= 2:
        _, still_cool = _prefill_side(obs, p, obs.num_prefill - 1)
        if still_cool:
            return Move("prefill", "decode", decode_hot)
    return None


def decide(obs: Observation, state: PolicyState, p: AdaptivePolicy) -> tuple[Move | None, PolicyState]:
    """One step of the policy; the caller passes the returned state back next time.

    When it returns a move, the caller carries it out and calls :func:`changed`
    once the worker has switched (or abandons it: nothing to report).
    """
    wish = wanted_move(obs, p)
    if wish is None:
        return None, replace(state, wish=None, streak=0)
    same = state.wish is not None and (state.wish.src, state.wish.dst) == (wish.src, wish.dst)
    streak = state.streak + 1 if same else 1
    state = replace(state, wish=wish, streak=streak)
    dwelling = state.last_change_at is not None and obs.now - state.last_change_at < p.min_dwell_s
    if streak < p.sustain or dwelling:
        return None, state
    return wish, replace(state, wish=None, streak=0)


def attainment(recent, slo_ms: tuple[float, float] | None) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) attainment of ``recent`` ``(ttft_s, tpot_s)`` pairs against ``slo_ms``
    ``(ttft_ms, tpot_ms)``: the shares meeting each; ``(None, None)`` without an SLO or data."""
    if slo_ms is None or not recent:
        return None, None
    ttft_s, tpot_s = slo_ms[0] / 1e3, slo_ms[1] / 1e3
    n = len(recent)
    return sum(t <= ttft_s for t, _ in recent) / n, sum(p <= tpot_s for _, p in recent) / n


def changed(state: PolicyState, now: float) -> PolicyState:
    """The state after a role change finished at ``now`` (starts the dwell time)."""
    return replace(state, last_change_at=now, wish=None, streak=0)
