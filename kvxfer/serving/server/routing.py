"""Which worker a request goes to: the routing policies and the router's prefix index.

A policy picks one of the live workers of a role (``candidates``) for a prompt::

    policy = make_policy("kv", block_size=16)
    policy.on_kv_event("w0", stored=[h0, h1], removed=[])   # from the worker's kv_events
    worker = policy.pick(candidates, prompt_ids)              # or route() for the hit count

A worker-like candidate has ``.name`` (unique in the server) and ``.load`` (the
requests it holds). With ``request_id`` the policy also books what the request
will cost its worker (the ledger, below), so the next pick sees it. The module is pure: no I/O, no clock, no threads, no torch;
the router calls it on its event loop and a virtual-clock simulator can call it
from a discrete-event loop.

**The prefix index** (:class:`PrefixIndex`) maps the chained block hashes of each
worker's prefix cache (:func:`kvxfer.serving.engine.block_manager.block_hash`, the
hashes its ``BlockManager`` keys its cache by, stable across processes) to the
workers holding them. The router hashes a prompt's full blocks with the same
function (the last token is never counted, as ``BlockManager.match_prefix``) and
walks the chain: a worker's *hit* is the length of the longest chain prefix it
holds. The walk stops at the first hash no candidate holds, so a prompt costs
one hash per matched block plus one. Bounds: at most ``max_blocks_per_worker``
hashes a worker (lowered to the worker's ``num_blocks`` by :meth:`set_capacity`;
a worker's cache never holds more, so a longer stream evicts that worker's
oldest entries), at most ``max_workers`` workers and at most ``max_entries``
entries in all (a worker storing past it evicts its own oldest entries, never
another worker's).

**Policies** (``kvxfer serve --routing``):

- ``least-loaded``: the candidate with the fewest requests, the first one on a
  tie. It keeps the index too, so the hits it gets by chance are counted.
- ``kv`` (:class:`KVRouting`, as Dynamo's KV router and Mooncake's Conductor):
  a worker's *gain* is its hit minus ``pool_hit_blocks`` (blocks the KV pool holds
  cost every worker the same load from the pool, so only local hits past them are
  an advantage), at least 0, and 0 below ``min_hit_blocks``. A worker is *eligible*
  if ``load <= min_load + load_gap`` (requests; ``min_load`` over all candidates).
  The request goes to the eligible worker of least *cost*, in blocks::

      cost = overlap_weight * (pending_prefill_blocks + prompt_blocks - gain) + held_blocks

  ``pending_prefill_blocks`` and ``held_blocks`` are the worker's share of the
  requests routed to it and not yet released (the ledger below): the prompt blocks
  it still has to compute, and the blocks its requests occupy (prompt plus
  ``max_tokens``). A hit spares prefill on a worker that computes the prompt and
  the transfer on a decode worker, so it lowers the cost either way. Equal costs:
  the fewest requests, then the first. Without a ledger (no ``request_id``) and
  without a hit every cost is equal: least-loaded's pick.

**The ledger.** ``route(..., request_id=rid, max_tokens=m, prefills=True)`` books
the request on the chosen worker: ``prompt_blocks - hit`` blocks to prefill (0 with
``prefills=False``: a decode worker that receives the prompt's KV) and
``ceil((len(prompt_ids) + m) / block_size)`` blocks held. The caller reports
:meth:`RoutingPolicy.prefilled` when the first token came (the prefill part goes)
and :meth:`RoutingPolicy.release` when a worker no longer holds the request (its
KV was sent, or the request ended: everything goes). :meth:`RoutingPolicy.forget`
drops a dead worker's bookings with its index entries. Both policies keep it
(``least-loaded`` ignores it), so callers need not know which one runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence as Seq

from ..channel.ipc import MAX_EVENT_HASHES
from ..engine.block_manager import HashChain

MAX_BLOCKS_PER_WORKER = 1 << 18  # index entries of one worker before set_capacity lowers it
MAX_WORKERS = 1024  # workers the index tracks at once
MAX_ENTRIES = 1 << 22  # (worker, hash) entries in all: a few hundred bytes each
OVERLAP_WEIGHT = 4.0  # kv: a block to prefill weighs as much as this many blocks held
_HASH_LIMIT = 1 << 64  # block_hash is a 64-bit digest


class WorkerLike(Protocol):
    name: str

    @property
    def load(self) -> int: ...


def prefix_hashes(prompt_ids: Seq[int], block_size: int) -> Iterator[int]:
    """The chained hashes of ``prompt_ids``'s full blocks, first block first, as the
    worker's ``BlockManager.match_prefix`` computes them (the last token never counts)."""
    chain = HashChain(block_size)  # computed lazily: a walk that stops early hashes no further
    for i in range((len(prompt_ids) - 1) // block_size):
        yield chain.upto(prompt_ids, i + 1)[i]


def _check_hashes(what: str, hashes) -> list[int]:
    if not isinstance(hashes, (list, tuple)):
        raise TypeError(f"{what} must be a list of block hashes, got {type(hashes).__name__}")
    # the common case at C speed (every element an int in range); else find the bad one
    if not hashes or (set(map(type, hashes)) == {int}
                      and min(hashes) >= 0 and max(hashes) < _HASH_LIMIT):
        return list(hashes)
    for h in hashes:
        if type(h) is not int or not 0 <= h < _HASH_LIMIT:
            raise ValueError(f"{what}: not a 64-bit block hash: {h!r:.40}")
    return list(hashes)


class PrefixIndex:
    """Block hash -> the workers whose prefix cache holds it (bounds: module docstring)."""

    def __init__(self, max_blocks_per_worker: int = MAX_BLOCKS_PER_WORKER,
                 max_workers: int = MAX_WORKERS, max_entries: int = MAX_ENTRIES) -> None:
        if min(max_blocks_per_worker, max_workers, max_entries) <= 0:
            raise ValueError("need max_blocks_per_worker, max_workers and max_entries > 0, got "
                             f"{max_blocks_per_worker}, {max_workers}, {max_entries}")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_workers = max_workers
        self.max_entries = max_entries
        self._num_entries = 0
        self._holders: dict[int, set[str]] = {}
        self._by_worker: dict[str, dict[int, None]] = {}  # insertion order: oldest first
        self._capacity: dict[str, int] = {}

    def __len__(self) -> int:
        """Entries (worker, hash) held."""
        return self._num_entries

    def num_blocks(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def holds(self, worker: str, block: int) -> bool:
        return block in self._by_worker.get(worker, ())

    def set_capacity(self, worker: str, num_blocks: int) -> None:
        """``worker``'s cache has ``num_blocks`` blocks: keep at most that many of its hashes."""
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r:.40}")
        self._capacity[worker] = min(num_blocks, self.max_blocks_per_worker)
        self._trim(worker)

    def apply(self, worker: str, stored: list[int], removed: list[int]) -> None:
        """One kv_events message of ``worker``: ``removed`` hashes go, then ``stored`` come.

        ``TypeError``/``ValueError`` (nothing changed) for a message that is not a list
        of 64-bit hashes, holds more than :data:`MAX_EVENT_HASHES`, or would track a
        worker past ``max_workers``."""
        if not isinstance(worker, str):
            raise TypeError(f"worker name must be a str, got {type(worker).__name__}")
        stored, removed = _check_hashes("stored", stored), _check_hashes("removed", removed)
        if len(stored) + len(removed) > MAX_EVENT_HASHES:
            raise ValueError(f"kv_events of {worker}: {len(stored) + len(removed)} hashes, "
                             f"at most {MAX_EVENT_HASHES} a message")
        mine = self._by_worker.get(worker)
        if mine is None:
            if not stored:
                return
            if len(self._by_worker) >= self.max_workers:
                raise ValueError(f"prefix index already tracks {self.max_workers} workers")
            mine = self._by_worker[worker] = {}
        for h in removed:
            if mine.pop(h, 0) is None:
                self._unhold(h, worker)
        holders = self._holders
        for h in stored:
            if h in mine:
                del mine[h]  # stored again: now the newest
            else:
                held = holders.get(h)
                if held is None:
                    holders[h] = {worker}
                else:
                    held.add(worker)
                self._num_entries += 1
            mine[h] = None
        self._trim(worker)
        if not mine:
            del self._by_worker[worker]

    def forget(self, worker: str) -> None:
        """Drop every entry of ``worker`` (it died, or its cache is gone)."""
        for h in self._by_worker.pop(worker, {}):
            self._unhold(h, worker)
        self._capacity.pop(worker, None)

    def hits(self, prompt_ids: Seq[int], block_size: int, workers: Seq[str]) -> dict[str, int]:
        """For each of ``workers``: how many leading full blocks of ``prompt_ids`` it holds."""
        out = dict.fromkeys(workers, 0)
        active = {w for w in out if w in self._by_worker}
        depth = 0
        if active:
            for h in prefix_hashes(prompt_ids, block_size):
                active &= self._holders.get(h, set())
                if not active:
                    break
                depth += 1
                for w in active:
                    out[w] = depth
        return out

    def _unhold(self, h: int, worker: str) -> None:
        self._num_entries -= 1
        holders = self._holders[h]
        holders.discard(worker)
        if not holders:
            del self._holders[h]

    def _trim(self, worker: str) -> None:
        mine = self._by_worker.get(worker)
        if mine is None:
            return
        cap = min(self._capacity.get(worker, self.max_blocks_per_worker),
                  self.max_entries - (self._num_entries - len(mine)))
        while len(mine) > cap:
            h = next(iter(mine))
            del mine[h]
            self._unhold(h, worker)


@dataclass(frozen=True)
class Route:
    """One routing decision: the worker (None: no candidate), its hit and the prompt's
    full blocks (``hit_blocks <= prompt_blocks``)."""

    worker: object | None
    hit_blocks: int
    prompt_blocks: int


def least_loaded(candidates: Seq[WorkerLike]):
    """The candidate with the fewest requests (the first on a tie); None if there is none."""
    return min(candidates, key=lambda w: w.load) if candidates else None


@dataclass
class Booking:
    """A request's cost to one worker, in blocks: to prefill (until its first token)
    and held (until the worker releases it)."""

    prefill_blocks: int
    held_blocks: int


class RoutingPolicy:
    """A policy's shared part: the prefix index, the ledger of booked requests and the
    routed-block totals.

    ``stats``: ``routed`` (decisions with a worker), ``hit_blocks`` (the chosen
    workers' hits) and ``prompt_blocks`` (the prompts' full blocks), summed.
    ``chooses_by_prefix``: whether the index decides the pick; where it does not, the
    index serves only the hit counts in :attr:`stats`."""

    name = ""
    chooses_by_prefix = True

    def __init__(self, block_size: int, *, max_blocks_per_worker: int = MAX_BLOCKS_PER_WORKER,
                 max_workers: int = MAX_WORKERS, max_entries: int = MAX_ENTRIES) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.index = PrefixIndex(max_blocks_per_worker, max_workers, max_entries)
        self.stats = {"routed": 0, "hit_blocks": 0, "prompt_blocks": 0}
        self._bookings: dict[str, dict[str, Booking]] = {}  # request id -> worker -> booking
        self._booked: dict[str, Booking] = {}  # worker -> the sums of its bookings

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, block_size={self.block_size})"

    def on_kv_event(self, worker_name: str, stored: list[int], removed: list[int]) -> None:
        """Apply one kv_events message (:meth:`PrefixIndex.apply`: typed errors, state intact)."""
        self.index.apply(worker_name, stored, removed)

    def set_capacity(self, worker_name: str, num_blocks: int) -> None:
        self.index.set_capacity(worker_name, num_blocks)

    def forget(self, worker_name: str) -> None:
        """``worker_name`` died or lost its cache: its index entries and bookings go."""
        self.index.forget(worker_name)
        self._booked.pop(worker_name, None)
        for rid in [rid for rid, mine in self._bookings.items() if worker_name in mine]:
            self._drop(rid, worker_name)

    def booked(self, worker_name: str) -> Booking:
        """The sums of ``worker_name``'s bookings (zeros when it has none)."""
        b = self._booked.get(worker_name)
        return Booking(b.prefill_blocks, b.held_blocks) if b else Booking(0, 0)

    def prefilled(self, request_id: str) -> None:
        """``request_id``'s first token came: its blocks to prefill leave every worker's
        booking. An unknown id is ignored (the request was never booked or is gone)."""
        for worker, b in self._bookings.get(request_id, {}).items():
            self._booked[worker].prefill_blocks -= b.prefill_blocks
            b.prefill_blocks = 0

    def release(self, request_id: str, worker_name: str | None = None) -> None:
        """``worker_name`` (None: every worker) no longer holds ``request_id``: its
        booking goes. Unknown ids and workers are ignored, so a release may repeat."""
        for worker in list(self._bookings.get(request_id, {})):
            if worker_name is None or worker == worker_name:
                self._drop(request_id, worker)

    def _drop(self, request_id: str, worker: str) -> None:
        mine = self._bookings[request_id]
        b = mine.pop(worker)
        total = self._booked.get(worker)
        if total is not None:
            total.prefill_blocks -= b.prefill_blocks
            total.held_blocks -= b.held_blocks
            if not total.held_blocks and not total.prefill_blocks:
                del self._booked[worker]
        if not mine:
            del self._bookings[request_id]

    def pick(self, candidates: Seq[WorkerLike], prompt_ids: Seq[int] | None = None, **kw):
        """The worker for ``prompt_ids`` among ``candidates`` (None if empty); keywords
        as :meth:`route`."""
        return self.route(candidates, prompt_ids, **kw).worker

    def route(self, candidates: Seq[WorkerLike], prompt_ids: Seq[int] | None = None, *,
              pool_hit_blocks: int = 0, request_id: str | None = None, max_tokens: int = 0,
              prefills: bool = True) -> Route:
        """:meth:`pick` with the chosen worker's hit; counts it in :attr:`stats`.

        ``pool_hit_blocks``: leading blocks of the prompt the KV pool holds (0 if
        unknown); only hits past them count as a worker's advantage. With
        ``request_id`` the request is booked on the chosen worker (the ledger,
        module docstring): ``max_tokens`` it may generate there, ``prefills`` whether
        that worker computes the prompt. A request id booked on that worker before
        is booked again (its old booking replaced)."""
        if not candidates:
            return Route(None, 0, 0)
        num_blocks = (len(prompt_ids) - 1) // self.block_size if prompt_ids else 0
        hits = (self.index.hits(prompt_ids, self.block_size, [w.name for w in candidates])
                if num_blocks else {})
        worker = self._choose(candidates, hits, max(0, pool_hit_blocks), num_blocks)
        hit = hits.get(worker.name, 0)
        self.stats["routed"] += 1
        self.stats["hit_blocks"] += hit
        self.stats["prompt_blocks"] += num_blocks
        if request_id is not None:
            num_tokens = (len(prompt_ids) if prompt_ids else 0) + max(0, max_tokens)
            self._book(request_id, worker.name,
                       Booking(num_blocks - hit if prefills else 0, -(-num_tokens // self.block_size)))
        return Route(worker, hit, num_blocks)

    def _book(self, request_id: str, worker: str, booking: Booking) -> None:
        if worker in self._bookings.get(request_id, {}):
            self._drop(request_id, worker)
        self._bookings.setdefault(request_id, {})[worker] = booking
        total = self._booked.setdefault(worker, Booking(0, 0))
        total.prefill_blocks += booking.prefill_blocks
        total.held_blocks += booking.held_blocks

    def _choose(self, candidates: Seq[WorkerLike], hits: dict[str, int], pool_hit_blocks: int,
                num_blocks: int):
        raise NotImplementedError


class LeastLoadedRouting(RoutingPolicy):
    """``least-loaded``: :func:`least_loaded`, the index and the ledger only observed."""

    name = "least-loaded"
    chooses_by_prefix = False

    def _choose(self, candidates, hits, pool_hit_blocks, num_blocks):
        return least_loaded(candidates)


class KVRouting(RoutingPolicy):
    """``kv``: the least cost in blocks (prefill weighted by ``overlap_weight``, plus
    blocks held) among the workers within ``load_gap`` requests of the least load
    (module docstring); ``min_hit_blocks``: a smaller gain counts as none."""

    name = "kv"

    def __init__(self, block_size: int, *, load_gap: int = 4, min_hit_blocks: int = 1,
                 overlap_weight: float = OVERLAP_WEIGHT, **index_bounds) -> None:
        super().__init__(block_size, **index_bounds)
        if type(load_gap) is not int or load_gap < 0:
            raise ValueError(f"load_gap must be an int >= 0, got {load_gap!r}")
        if type(min_hit_blocks) is not int or min_hit_blocks < 1:
            raise ValueError(f"min_hit_blocks must be an int >= 1, got {min_hit_blocks!r}")
        if type(overlap_weight) not in (int, float) or not 0 <= overlap_weight < float("inf"):
            raise ValueError(f"overlap_weight must be a finite number >= 0, got {overlap_weight!r}")
        self.load_gap = load_gap
        self.min_hit_blocks = min_hit_blocks
        self.overlap_weight = overlap_weight

    def cost(self, worker_name: str, hit_blocks: int, num_blocks: int,
             pool_hit_blocks: int = 0) -> float:
        """The cost in blocks of sending a prompt of ``num_blocks`` full blocks, of which
        ``worker_name`` holds ``hit_blocks``, to that worker (module docstring)."""
        gain = max(0, hit_blocks - pool_hit_blocks)
        if gain < self.min_hit_blocks:
            gain = 0
        b = self._booked.get(worker_name)
        pending, held = (b.prefill_blocks, b.held_blocks) if b else (0, 0)
        return self.overlap_weight * (pending + num_blocks - gain) + held

    def _choose(self, candidates, hits, pool_hit_blocks, num_blocks):
        limit = min(w.load for w in candidates) + self.load_gap
        best, best_key = None, None
        for w in candidates:
            if w.load > limit:
                continue
            key = (self.cost(w.name, hits.get(w.name, 0), num_blocks, pool_hit_blocks), w.load)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best


POLICIES = {p.name: p for p in (LeastLoadedRouting, KVRouting)}


def make_policy(name: str, block_size: int, **knobs) -> RoutingPolicy:
    """The policy ``name`` (``"least-loaded"`` or ``"kv"``) for blocks of ``block_size``
    tokens. Knobs: ``max_blocks_per_worker``, ``max_workers``, ``max_entries`` (both); ``load_gap``,
    ``min_hit_blocks``, ``overlap_weight`` (``kv``). ``ValueError`` for an unknown name, ``TypeError``
    for a knob the policy does not take."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    return cls(block_size, **knobs)
