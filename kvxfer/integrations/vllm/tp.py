"""Tensor parallelism across a P/D pair: which kv heads each rank holds, which ranks meet.

vLLM splits a model's ``num_kv_heads`` evenly over ``tensor_parallel_size`` ranks
(``get_num_kv_heads``): rank ``r`` of ``n`` holds the global heads
``[r * H / n, (r + 1) * H / n)``. Each rank runs its own kvxfer agent on its own
slice of the pool (``KVLayout(..., tp_rank=r, tp_size=n)``), so heads, not ranks,
are what a transfer names: a D rank receives exactly its heads from every P rank
that holds some of them (P TP 2 -> D TP 1: both P ranks write into D's one pool;
P TP 1 -> D TP 2: P's one rank writes each D rank's half), and the agent checks the
overlap. What P hands D in ``kv_transfer_params`` (:func:`ranks_param`) lists every
P rank's agent address and head range.

A pair cannot be mapped when the two engines do not hold the same model's heads
(``num_kv_heads`` differ) or where vLLM replicates kv heads (``tensor_parallel_size``
above ``num_kv_heads``: several ranks hold the same head); :func:`check_pair` and
:func:`rank_heads` raise :class:`~kvxfer.errors.LayoutMismatch` naming the counts.

Agents are named ``vllm-<role>-<engine id>-tp<rank>of<size>`` (:func:`agent_name`);
a P rank learns from a matched D agent's name which heads it received
(:func:`heads_of_peer`), so it knows when every D rank that needs its heads has them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import LayoutMismatch

_NAME_TP = re.compile(r"-tp(\d+)of(\d+)$")


@dataclass(frozen=True)
class RankInfo:
    """One P rank as D sees it: its agent's ``address`` and global kv heads ``[lo, hi)``."""

    address: str
    lo: int
    hi: int


def rank_heads(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple:
    """Global ``(lo, hi)`` kv heads of rank ``tp_rank`` of ``tp_size``; LayoutMismatch
    where the heads do not split evenly (vLLM replicates them then)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got {tp_rank} of {tp_size}")
    if num_kv_heads < 1 or num_kv_heads % tp_size:
        raise LayoutMismatch(
            f"{num_kv_heads} kv heads do not split evenly over tensor_parallel_size={tp_size} "
            "(vLLM replicates kv heads then); KVXferConnector needs each rank to hold its own heads")
    per = num_kv_heads // tp_size
    return (tp_rank * per, (tp_rank + 1) * per)


def agent_name(role: str, engine_id, tp_rank: int, tp_size: int) -> str:
    return f"vllm-{role}-{engine_id}-tp{tp_rank}of{tp_size}"


def heads_of_peer(name: str | None, num_kv_heads: int) -> tuple:
    """Global heads a peer agent named by :func:`agent_name` holds (both engines hold
    ``num_kv_heads``: the layout fingerprint checked that at connect); every head for a
    name without a rank (one agent for the whole model)."""
    m = _NAME_TP.search(name or "")
    if m is None:
        return (0, num_kv_heads)
    return rank_heads(num_kv_heads, int(m.group(1)), int(m.group(2)))


def ranks_param(ranks) -> list:
    """P's ranks (``[RankInfo]`` in rank order) as ``kv_transfer_params["remote_ranks"]``."""
    return [[r.address, r.lo, r.hi] for r in ranks]


def parse_ranks(params: dict) -> tuple:
    """``((RankInfo, ...), p_kv_heads)`` from P's ``kv_transfer_params``: ``remote_ranks``
    and ``remote_kv_heads``; a TP 1 P's ``remote_addr`` alone gives ``((addr, 0, 0),), 0``
    (it holds every head: the receiver fills in its own count). Raises ValueError for
    malformed params; :func:`check_pair` checks that the ranks map onto a receiver."""
    raw = params.get("remote_ranks")
    if raw is None:
        return (RankInfo(str(params["remote_addr"]), 0, 0),), 0
    try:
        ranks = tuple(RankInfo(str(a), int(lo), int(hi)) for a, lo, hi in raw)
        return ranks, int(params["remote_kv_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed remote_ranks/remote_kv_heads in kv_transfer_params: {raw!r}") from exc


def whole(ranks, num_kv_heads: int) -> tuple:
    """``ranks`` with a TP 1 P's unknown head count (``hi == 0``) filled in."""
    return tuple(RankInfo(r.address, 0, num_kv_heads) if r.hi == 0 else r for r in ranks)


def check_pair(ranks, p_kv_heads: int, d_kv_heads: int) -> None:
    """P's ranks must hold the same model's heads as D, each exactly once: LayoutMismatch
    otherwise, naming both counts (the pair is refused before any connect)."""
    if p_kv_heads != d_kv_heads:
        raise LayoutMismatch(f"cannot map kv heads: the prefill engine has {p_kv_heads}, "
                             f"this decode engine {d_kv_heads}")
    spans = sorted((r.lo, r.hi) for r in ranks)
    edge = 0
    for lo, hi in spans:
        if lo != edge or hi <= lo:
            raise LayoutMismatch(f"cannot map kv heads: the prefill ranks hold {spans}, "
                                 f"not each of the {d_kv_heads} heads once")
        edge = hi
    if edge != d_kv_heads:
        raise LayoutMismatch(f"cannot map kv heads: the prefill ranks hold {spans}, "
                             f"not each of the {d_kv_heads} heads once")


def overlapping(ranks, lo: int, hi: int) -> tuple:
    """The P ranks holding some of the heads ``[lo, hi)``: the ones a D rank connects to."""
    return tuple(r for r in ranks if r.lo < hi and lo < r.hi)


def covers(spans, lo: int, hi: int) -> bool:
    """Whether the union of ``spans`` (``(lo, hi)`` pairs) covers ``[lo, hi)``."""
    edge = lo
    for a, b in sorted(spans):
        if a > edge:
            return False
        edge = max(edge, b)
        if edge >= hi:
            return True
    return edge >= hi


def rank_listen(listen: str, tp_rank: int) -> str:
    """Rank ``tp_rank``'s listen address: port 0 stays 0 (any free port), a fixed port
    ``p`` becomes ``p + tp_rank`` so the ranks of one engine do not collide."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen must be 'host:port', got {listen!r}")
    return listen if int(port) == 0 else f"{host}:{int(port) + tp_rank}"
