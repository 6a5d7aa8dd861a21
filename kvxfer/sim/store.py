"""The KV pool on the virtual clock: store nodes as their real index and placement, no bytes.

``kvxfer serve --store`` gives every prefill worker a :class:`kvxfer.KVStore` client, which
its :class:`~kvxfer.serving.workers.pool.PrefillPool` drives (lookup and get when a prompt
is admitted, an async put after its prefill). On the virtual clock the same
``PrefillPool`` runs against :class:`VirtualStoreClient`, which answers as a client would
from :class:`VirtualStore`:

- each node is the node's own :class:`~kvxfer.store.index.SlotIndex` (``blocks_per_node``
  slots of one real block each: LRU eviction past its high watermark, an object readable
  only once its put committed), and each key goes to the node
  :class:`~kvxfer.store.placement.Placement` ranks first (rendezvous hashing, one replica);
- the bytes move as modelled times over :class:`~kvxfer.serving.simulated.link.NicQueue`\\ s, one a
  direction (NICs are full duplex): a put of ``n`` blocks occupies the worker's egress
  (the queue its KV sends to decode workers use) for ``n`` real blocks and each node's
  ingress for its share; a get, each node's egress for its share and the worker's
  ingress for ``n``. It ends when the slowest of them is done (the profile's link on
  both sides);
- a **get** is waited for by the worker (``PrefillPool.admit`` blocks on it, as the real
  worker's loop does): it starts once the worker's current step and earlier gets are
  done, and the worker's next step starts when it ended (:attr:`VirtualStoreClient.ready_at`);
- a **put** reserves its slots when it is posted and commits them when its modelled
  transfer ends (``on_put_done`` is then called, so the caller can let the worker
  release the blocks the put read, as :meth:`PrefillPool.poll` does).

Not modelled: lookup times (a 64-key lookup takes ~20-30 us from a node's key table on
the same host, a few hundred us as requests to a node; docs/benchmarks.md), nodes
failing, pins outlasting the copy (a get's objects are unpinned at once: nothing else
happens at that virtual instant).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import KVXferError
from ..store import index as ix
from ..store.alloc import chunk_bytes
from ..store.placement import Placement
from ..store.results import GetResult, PutResult
from ..serving.simulated.link import NicQueue

FMT = "vclock"  # the one object format of a simulated model
LEASE_S = 1e9  # reservations and pins never lapse on their own: commits and releases end them


@dataclass(frozen=True)
class StoreSpec:
    """A pool of ``num_nodes`` store nodes of ``blocks_per_node`` one-block slots each."""

    num_nodes: int
    blocks_per_node: int

    def __post_init__(self) -> None:
        for name in ("num_nodes", "blocks_per_node"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"store {name} must be an int >= 1, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> "StoreSpec":
        """``"NODESxBLOCKS"`` (e.g. ``"2x125000"``); ``ValueError`` otherwise."""
        nodes, sep, blocks = str(text).lower().partition("x")
        if not sep or not nodes.strip().isdigit() or not blocks.strip().isdigit():
            raise ValueError(f"a store is NODESxBLOCKS (e.g. 2x125000), got {text!r}")
        return cls(int(nodes), int(blocks))


class VirtualHandle:
    """What :class:`kvxfer.TransferHandle` shows a ``PrefillPool``: ``done()``, ``state``
    (``"pending"``, ``"done"``, ``"failed"``), ``error``, ``nbytes``, ``result`` (a
    store handle's :class:`~kvxfer.store.results.PutResult` / ``GetResult``, set when it
    ends) and ``wait()``, which raises ``error`` if it failed and never blocks (a pending
    one is a caller's bug)."""

    def __init__(self) -> None:
        self.state, self.error, self.nbytes, self.result = "pending", None, 0, None

    def done(self) -> bool:
        return self.state != "pending"

    def wait(self, timeout: float | None = None) -> None:
        if self.state == "pending":
            raise RuntimeError("a virtual handle ends on the virtual clock, never by waiting")
        if self.error is not None:
            raise self.error

    def _end(self, error: KVXferError | None = None) -> None:
        self.state, self.error = ("done", None) if error is None else ("failed", error)


class VirtualStore:
    """The nodes of a pool (module docstring); ``now()`` is the virtual clock's time."""

    def __init__(self, spec: StoreSpec, profile, now) -> None:
        self.spec = spec
        self.block_bytes = profile.block_bytes
        self.now = now
        names = [f"store{i}" for i in range(spec.num_nodes)]
        # capacity: blocks_per_node chunks of one block each
        self.nodes = {n: ix.SlotIndex(spec.blocks_per_node * chunk_bytes(self.block_bytes), self.block_bytes)
                      for n in names}
        self.ingress = {n: NicQueue(profile.link) for n in names}  # puts
        self.egress = {n: NicQueue(profile.link) for n in names}  # gets
        self.placement = Placement(names)

    def node_of(self, key: bytes) -> str:
        return self.placement.owners(key)[0]

    def lookup(self, keys) -> int:
        """How many leading ``keys`` are readable in their nodes now (recency untouched)."""
        n = 0
        for k in keys:
            if not self.nodes[self.node_of(k)].contains(k):
                break
            n += 1
        return n

    def transfer(self, start: float, worker_nic: NicQueue, keys, *, put: bool) -> float:
        """The end of moving ``keys``' objects between a worker's ``worker_nic`` and their
        nodes (to them: ``put``), from ``start``."""
        shares: dict[str, int] = {}
        for k in keys:
            node = self.node_of(k)
            shares[node] = shares.get(node, 0) + 1
        nics = self.ingress if put else self.egress
        end = worker_nic.reserve(start, len(keys) * self.block_bytes)[1]
        for node, n in shares.items():
            end = max(end, nics[node].reserve(start, n * self.block_bytes)[1])
        return end

    def stats(self) -> dict:
        """Summed over the nodes: :meth:`SlotIndex.stats`' counts."""
        out: dict = {}
        for index in self.nodes.values():
            for k, v in index.stats().items():
                if isinstance(v, int):
                    out[k] = out.get(k, 0) + v
        return out


class VirtualStoreClient:
    """One worker's client of a :class:`VirtualStore`: ``lookup``, ``get`` and ``put`` as
    :class:`kvxfer.KVStore`'s (the layout and block ids are not read: no bytes move).

    ``busy_until()``: when the worker's current step ends (a get waits for it);
    ``schedule(t, fn, *args)``: the virtual clock's event queue; ``on_put_done()``: called
    after a put committed."""

    def __init__(self, store: VirtualStore, nic: NicQueue, busy_until, schedule, on_put_done) -> None:
        self.store = store
        self.nic = nic  # the worker's egress
        self.ingress = NicQueue(nic.link)
        self.owner = id(self)
        self.busy_until = busy_until
        self.schedule = schedule
        self.on_put_done = on_put_done
        self.ready_at = 0.0  # the end of the last get: the worker's next step starts after it

    def lookup(self, keys) -> int:
        return self.store.lookup(keys)

    def get(self, keys, layout, block_ids):
        """The objects of ``keys`` (all in the pool: looked up at this instant), read at
        once; the worker waits until their modelled transfer ended (:attr:`ready_at`)."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        store, handle, error = self.store, VirtualHandle(), None
        for n, k in enumerate(keys):
            index = store.nodes[store.node_of(k)]
            obj, pin = index.get(k, FMT, self.owner, store.now(), LEASE_S)
            if obj is None:
                error = KVXferError(f"pool get: key {n} of {len(keys)} is not in the pool")
                error.loaded = n
                keys = keys[:n]
                break
            index.release(pin, self.owner)
        start = max(store.now(), self.busy_until(), self.ready_at)
        self.ready_at = store.transfer(start, self.ingress, keys, put=False)
        handle.nbytes = len(keys) * store.block_bytes
        handle.result = GetResult(len(keys), 0, len(block_ids) - len(keys), 0)  # no disk tier here
        handle._end(error)
        return handle

    def put(self, keys, layout, block_ids):
        """Reserve a slot for each key not in the pool yet (present or being written: left
        alone) now; commit them when the modelled transfer ends. The handle fails if a
        node had no slot to give (every one pending or pinned) or this client holds its
        ``max_pending`` reservations already."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        store, handle = self.store, VirtualHandle()
        now, reserved, full, present, busy = store.now(), [], 0, 0, 0
        for k in keys:
            index = store.nodes[store.node_of(k)]
            code, obj = index.reserve(k, store.block_bytes, FMT, self.owner, now, LEASE_S)
            if code == ix.RESERVED:
                reserved.append((index, k, obj.token))
            elif code == ix.PRESENT:
                present += 1
            elif code == ix.BUSY:  # being written by another client: left alone, skipped
                busy += 1
            else:
                full += 1
        end = store.transfer(now, self.nic, [k for _, k, _ in reserved], put=True)
        self.schedule(end, self._commit, handle, reserved, full, present, busy)
        return handle

    def _commit(self, handle: VirtualHandle, reserved: list, full: int, present: int, busy: int) -> None:
        for index, key, token in reserved:
            index.commit(key, token, 0, self.owner)
        handle.nbytes = len(reserved) * self.store.block_bytes
        handle.result = PutResult(len(reserved), present, full + busy, 0)
        handle._end(KVXferError(f"pool put: {full} objects found no free slot") if full else None)
        self.on_put_done()

    def close(self) -> None:
        """This client left: the nodes end its reservations and pins."""
        for index in self.store.nodes.values():
            index.forget_owner(self.owner)
