"""Which worker a request goes to: the routing policies and the router's prefix index.

A policy picks one of the live workers of a role (``candidates``) for a prompt::

    policy = make_policy("kv", block_size=16)
    policy.on_kv_event("w0", stored=[h0, h1], removed=[])   # from the worker's kv_events
    worker = policy.pick(candidates, prompt_ids)              # or route() for the hit count

A worker-like candidate has ``.name`` (unique in the server) and ``.load`` (the
requests it holds). The module is pure: no I/O, no clock, no threads, no torch;
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
- ``kv`` (:class:`KVRouting`, as Mooncake's Conductor): a worker's *gain* is its
  hit minus ``pool_hit_blocks`` (blocks the KV pool holds cost every worker the
  same load from the pool, so only local hits past them are an advantage), at
  least 0. A worker is *eligible* if ``load <= min_load + load_gap`` (``min_load``
  over all candidates). The request goes to the eligible worker with the largest
  gain (fewest requests among equal gains, then the first); if no eligible
  worker gains ``min_hit_blocks`` or more, to the least-loaded worker. So a
  cached prefix draws its request until that worker holds ``load_gap`` more
  requests than the least-loaded one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence as Seq

from ..channel.ipc import MAX_EVENT_HASHES
from ..engine.block_manager import HashChain

MAX_BLOCKS_PER_WORKER = 1 << 18  # index entries of one worker before set_capacity lowers it
MAX_WORKERS = 1024  # workers the index tracks at once
MAX_ENTRIES = 1 << 22  # (worker, hash) entries in all: a few hundred bytes each
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


class RoutingPolicy:
    """A policy's shared part: the prefix index and the routed-block totals.

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, block_size={self.block_size})"

    def on_kv_event(self, worker_name: str, stored: list[int], removed: list[int]) -> None:
        """Apply one kv_events message (:meth:`PrefixIndex.apply`: typed errors, state intact)."""
        self.index.apply(worker_name, stored, removed)

    def set_capacity(self, worker_name: str, num_blocks: int) -> None:
        self.index.set_capacity(worker_name, num_blocks)

    def forget(self, worker_name: str) -> None:
        """``worker_name`` died or lost its cache: its index entries go."""
        self.index.forget(worker_name)

    def pick(self, candidates: Seq[WorkerLike], prompt_ids: Seq[int] | None = None, *,
             pool_hit_blocks: int = 0):
        """The worker for ``prompt_ids`` among ``candidates`` (None if empty)."""
        return self.route(candidates, prompt_ids, pool_hit_blocks=pool_hit_blocks).worker

    def route(self, candidates: Seq[WorkerLike], prompt_ids: Seq[int] | None = None, *,
              pool_hit_blocks: int = 0) -> Route:
        """:meth:`pick` with the chosen worker's hit; counts it in :attr:`stats`.

        ``pool_hit_blocks``: leading blocks of the prompt the KV pool holds (0 if
        unknown); only hits past them count as a worker's advantage."""
        if not candidates:
            return Route(None, 0, 0)
        num_blocks = (len(prompt_ids) - 1) // self.block_size if prompt_ids else 0
        hits = (self.index.hits(prompt_ids, self.block_size, [w.name for w in candidates])
                if num_blocks else {})
        worker = self._choose(candidates, hits, max(0, pool_hit_blocks))
        hit = hits.get(worker.name, 0)
        self.stats["routed"] += 1
        self.stats["hit_blocks"] += hit
        self.stats["prompt_blocks"] += num_blocks
        return Route(worker, hit, num_blocks)

    def _choose(self, candidates: Seq[WorkerLike], hits: dict[str, int], pool_hit_blocks: int):
        raise NotImplementedError


class LeastLoadedRouting(RoutingPolicy):
    """``least-loaded``: :func:`least_loaded`, the index only observed."""

    name = "least-loaded"
    chooses_by_prefix = False

    def _choose(self, candidates, hits, pool_hit_blocks):
        return least_loaded(candidates)


class KVRouting(RoutingPolicy):
    """``kv``: the largest local prefix hit within ``load_gap`` of the least load
    (module docstring); ``min_hit_blocks``: a smaller gain is no reason to leave
    the least-loaded worker."""

    name = "kv"

    def __init__(self, block_size: int, *, load_gap: int = 4, min_hit_blocks: int = 1,
                 **index_bounds) -> None:
        super().__init__(block_size, **index_bounds)
        if type(load_gap) is not int or load_gap < 0:
            raise ValueError(f"load_gap must be an int >= 0, got {load_gap!r}")
        if type(min_hit_blocks) is not int or min_hit_blocks < 1:
            raise ValueError(f"min_hit_blocks must be an int >= 1, got {min_hit_blocks!r}")
        self.load_gap = load_gap
        self.min_hit_blocks = min_hit_blocks

    def _choose(self, candidates, hits, pool_hit_blocks):
        if not hits:
            return least_loaded(candidates)
        limit = min(w.load for w in candidates) + self.load_gap
        best, best_gain = None, self.min_hit_blocks - 1
        for w in candidates:
            if w.load > limit:
                continue
            gain = hits[w.name] - pool_hit_blocks
            if gain > best_gain or (gain == best_gain and best is not None and w.load < best.load):
                best, best_gain = w, gain
        return best if best is not None else least_loaded(candidates)


POLICIES = {p.name: p for p in (LeastLoadedRouting, KVRouting)}


def make_policy(name: str, block_size: int, **knobs) -> RoutingPolicy:
    """The policy ``name`` (``"least-loaded"`` or ``"kv"``) for blocks of ``block_size``
    tokens. Knobs: ``max_blocks_per_worker``, ``max_workers``, ``max_entries`` (both); ``load_gap``,
    ``min_hit_blocks`` (``kv``). ``ValueError`` for an unknown name, ``TypeError``
    for a knob the policy does not take."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    return cls(block_size, **knobs)
