"""``kvxfer.KVStore``: an engine's client of the KV pool.

::

    store = kvxfer.KVStore(nodes=["10.0.0.5:7600", "10.0.0.6:7600"], secret=secret)
    # or KVStore(discovery="etcd://10.0.0.2:2379", secret=secret)
    keys = kvxfer.block_keys(prompt_ids, block_size, salt=model_identity)
    n = store.lookup(keys)                          # leading keys in the pool
    store.get(keys[:n], layout, block_ids[:n]).wait(timeout=10)
    store.put(keys[n:], layout, block_ids[n:])      # async: a TransferHandle
    store.stats(); store.close()

Placement (:mod:`kvxfer.store.placement`): each key goes to its highest-ranked live
node(s) by rendezvous hashing; no master is asked. A node that fails a request (dropped
connection, no answer within ``timeout``, or a handshake refusing this client's secret)
is marked down: its keys are misses (lookups stop at them, gets fail on them, puts place
them on the next node) until ``retry_s`` later, when the client tries it again. With
every node down, lookups find nothing and puts count every key skipped.

Data moves one-sided between a registered staging buffer of this client and the node's
slots (no byte of KV through a socket): a put packs each block into staging
(:mod:`kvxfer.store.objects`), writes it into the slot the node reserved, then commits
with its checksum (or writes straight from the blocks when their runs are long). A node
on this host also keeps a few **spare** slots reserved for this client (asked for after
each put, off its critical path): a put of whole objects there skips the keys its key
table shows present, writes the others into spares and commits them under their keys,
one round trip instead of two (a put with too few spares asks for free ones first, and
reserves the keys it still has none for); a TP
rank's put reserves, writes and commits its part of each object (its heads, with the
part's checksum), and the node publishes the object once the group's parts cover every
head; a get reads pinned slots into staging, checks every object's checksum (every
part's) and unpacks the good ones. A put or get runs on the client's worker thread; the handle is
done when the objects are committed (put) or the blocks hold the KV (get).
"""
from __future__ import annotations

import bisect
import logging
import os
import queue
import threading
import time
from operator import itemgetter

from .._native import load
from ..secrets import normalize_secret
from ..errors import (AuthenticationError, InvalidDescriptor, KVXferError, LimitExceeded, PeerDisconnected,
                      StoreMiss, StorePartConflict, TransferTimeout)
from ..handle import HandleCompleter
from . import protocol as wire
from .conn import NodeConn, NodeError
from .key_table import ABSENT, PRESENT, UNKNOWN
from .keys import check_keys
from .members import check_address
from .objects import ObjectFormat, checksum
from .placement import Placement
from .results import OpReport
from .tiers import TIER_COUNTS
from ..transport.base import LOOKUP_MAX_KEYS
from .protocol import MAX_KEYS, NO_CRC, Req

log = logging.getLogger("kvxfer.store")

__all__ = ["KVStore"]

MAX_QUEUED_OPS = 1024
# keys per GET: a node answers at most MAX_REPLY_PARTS checksums per reply (the rest miss),
# so objects of up to 16 parts (TP degree 16) always fit
MAX_GET_KEYS = 1024
# a get's reads per node batch go in at least READ_PIECES pieces of at most READ_PIECE_BYTES
# (but whole objects), each checked while the next ones move: a small piece is still in
# cache when its checksum reads it
READ_PIECES = 8
READ_PIECE_BYTES = 4 << 20
# spare slots a connection to a node on this host keeps for the next put (asked for after a
# put, as many as it wrote, up to this, a 2,048-token prompt's blocks at 16 tokens a block,
# and to 1/16 of the node's slots, so that a small node is not held by spares)
SPARES_HELD = 128


def _checksums(sums) -> list:
    """:func:`checksum` of each ``(addrs, lengths)`` (the hasher thread runs this)."""
    return [checksum(a, n) for a, n in sums]


def _verify(checks) -> list:
    """Per object, whether every ``(addrs, lengths, crc)`` of its :meth:`ObjectFormat.checks`
    holds (None: a malformed checksum, bad; an object put without one, ``NO_CRC``, never
    reaches here: :meth:`KVStore._screen` refused it)."""
    return [c is not None and all(checksum(a, n) == crc for a, n, crc in c) for c in checks]


class KVStore:
    """``KVStore(nodes=["HOST:PORT", ...] | discovery="etcd://...", secret=..., ...)``.

    ``secret``: the deployment's shared secret (bytes or str, >= 16 bytes).
    ``replicas``: nodes each object is put on (gets and lookups ask the first live one
    that holds it). ``timeout``: seconds a node may take to answer one request or move
    one batch before it is marked down. ``retry_s``: how long a node stays down.
    ``staging_bytes``: the registered buffer objects pass through (a put or get moves at
    most this much per batch; one object must fit). ``backend``: as for the Agent.
    ``checksum=False`` skips the XXH3-64 checksum at put and its check at get (to measure what it
    costs; objects put so carry no checksum, and no client can verify them).
    """

    def __init__(self, nodes=None, discovery=None, *, secret, replicas: int = 1, timeout: float = 2.0,
                 retry_s: float = 2.0, staging_bytes: int = 64 << 20, backend: str = "auto",
                 checksum: bool = True) -> None:
        import kvxfer
        from ..transport import make_backend

        if (nodes is None) == (discovery is None):
            raise ValueError("give exactly one of nodes=[...] or discovery='etcd://...'")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        self._secret = normalize_secret(secret)
        self.replicas, self.timeout, self.retry_s = replicas, float(timeout), float(retry_s)
        self.checksum = bool(checksum)
        self._lock = threading.Lock()
        self._members: list[str] = []
        self._conns: dict[str, NodeConn] = {}
        self._down: dict[str, float] = {}  # address -> monotonic time it may be tried again
        self._refused: set[str] = set()  # members whose last handshake refused our secret
        self.client_id = os.urandom(16).hex()  # this client's identity for the nodes' quotas, over reconnects
        self._placements: dict[int, Placement] = {}
        self._pools: dict[int, tuple] = {}  # id(layout) -> (layout, backend region ids)
        self._formats: dict[int, ObjectFormat] = {}
        self._watch = self._discovery = None
        if nodes is not None:
            if isinstance(nodes, str):
                nodes = [nodes]
            self._members = sorted({check_address(a) for a in nodes})
            if not self._members:
                raise ValueError("nodes must name at least one HOST:PORT")
        self.counters = {"puts": 0, "put_objects": 0, "put_present": 0, "put_skipped": 0, "put_conflicts": 0, "gets": 0,
                         "get_objects": 0, "get_disk_objects": 0, "get_misses": 0, "checksum_failures": 0,
                         "node_failures": 0, "auth_failures": 0, "unverified_refused": 0,
                         "lookup_table_reads": 0, "lookup_requests": 0, "lookup_backend_messages": 0}
        self._backend = make_backend(backend)
        self._staging = kvxfer.shared_empty(int(staging_bytes))  # uint8 [staging_bytes]
        self._stage_ptr = self._staging.data_ptr()
        self._stage_region = self._backend.register_tensor(self._staging)
        self._ops: queue.Queue = queue.Queue(MAX_QUEUED_OPS)
        self._closed = False
        self._moved = 0  # bytes the running operation moved (worker thread only)
        from concurrent.futures import ThreadPoolExecutor

        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvxfer-store-checksum")
        self._worker = threading.Thread(target=self._work, name="kvxfer-store-client", daemon=True)
        self._worker.start()
        if discovery is not None:
            self._start_discovery(discovery)

    # ---- membership ------------------------------------------------------------------
    def _start_discovery(self, discovery) -> None:
        from ..discovery import Discovery
        from .members import open_store_discovery, store_addresses

        disc = open_store_discovery(discovery) if isinstance(discovery, str) else discovery
        if not isinstance(disc, Discovery):
            raise TypeError("discovery must be a URL or a kvxfer.discovery.Discovery")
        self._discovery = disc
        first = threading.Event()

        def on_change(members: dict) -> None:
            addrs = store_addresses(members)
            with self._lock:
                self._members = addrs
            first.set()

        self._watch = disc.watch(on_change)
        first.wait(self.timeout + 3.0)  # the first view (or none, if etcd is unreachable: no nodes yet)

    def nodes(self) -> dict:
        """``{address: "up" | "down"}`` for every known node."""
        now = time.monotonic()
        with self._lock:
            return {a: ("down" if self._down.get(a, 0) > now else "up") for a in self._members}

    def _live(self) -> list:
        now = time.monotonic()
        with self._lock:
            return [a for a in self._members if self._down.get(a, 0) <= now]

    def _placement(self, replicas: int) -> Placement:
        """Placement over the live nodes now (memoized per membership and replica count)."""
        live = tuple(sorted(self._live()))
        cached = self._placements.get(replicas)
        if cached is None or cached.nodes != live:
            cached = self._placements[replicas] = Placement(live, replicas)
        return cached

    def _conn(self, address: str) -> NodeConn:
        with self._lock:
            c = self._conns.get(address)
        if c is not None and not c.closed:
            return c
        c = NodeConn.open(address, self._secret, self._backend, self.timeout, client_id=self.client_id)
        with self._lock:
            old = self._conns.get(address)
            if old is not None and not old.closed:
                c.close()
                return old
            self._conns[address] = c
            self._down.pop(address, None)
            self._refused.discard(address)
        return c

    def _mark_down(self, address: str, exc: BaseException) -> None:
        """Take ``address`` out of placement for ``retry_s``. A member that refuses this
        client's secret (a port squatter, a stale discovery record, a node left on an old
        secret) is down like a dead one, logged once with its address until it
        authenticates again; only when **every** member refuses it is the secret this
        client's misconfiguration, and the :class:`~kvxfer.AuthenticationError` is raised."""
        refused = isinstance(exc, AuthenticationError)
        with self._lock:
            self._down[address] = time.monotonic() + self.retry_s
            c = self._conns.pop(address, None)
            self.counters["node_failures"] += 1
            first = refused and address not in self._refused
            if refused:
                self._refused.add(address)
                self.counters["auth_failures"] += 1
            everyone = refused and bool(self._members) and self._refused.issuperset(self._members)
        if c is not None:
            c.close()
        if first:
            log.error("store node %s refused this client's secret (%s): down like a dead node, the pool serves "
                      "from the others (logged once, until it authenticates)", address, exc)
        elif not refused:
            log.warning("store node %s is down for %.1f s: %s", address, self.retry_s, exc)
        if everyone:
            raise exc

    def _route(self, keys) -> dict:
        """``{address: [positions]}``: each key's first live owner."""
        return self._placement(1).route(keys)

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, keys) -> int:
        """How many leading ``keys`` (bytes, 1..64 each) are in the pool now.

        A node on this host is answered from its key table in shared memory (no request;
        :mod:`kvxfer.store.key_table`), unless the table is stale or cannot tell. Every
        other node that owns one of the keys before the first one known absent gets one
        message through the backend, which the node's backend answers from the same table
        in its progress (csrc/remote_lookup.cpp); a node that cannot tell, or answers no
        such message, gets a request on its socket. Messages and requests are all in
        flight at once. A node that fails counts its keys as absent (and is marked down)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        routes = self._route(keys)
        if not routes:  # no live node: a key whose node is down is absent, never assumed present
            return 0
        # the answer is the first position that some node does not hold (or cannot answer for)
        first_absent = len(keys)
        ask = []  # (address, positions): nodes to send a request
        for addr, pos in routes.items():
            codes = self._read_table(addr, keys, pos)
            if codes is None:
                ask.append((addr, pos))
            elif (j := codes.find(ABSENT)) >= 0:
                first_absent = min(first_absent, pos[j])
        if ask:
            ask, first_absent = self._lookup_by_backend(keys, ask, first_absent)
        sent = []  # (address, connection (locked), [(request id, positions)])
        try:
            for addr, pos in ask:
                c, pos, first_absent = self._lookup_conn(addr, pos, first_absent)
                if c is None:
                    continue
                c.lock.acquire()
                reqs: list = []
                sent.append((addr, c, reqs))
                try:
                    for start in range(0, len(pos), MAX_KEYS):
                        part = pos[start:start + MAX_KEYS]
                        reqs.append((c.send(Req.LOOKUP, {"keys": [keys[i] for i in part]}), part))
                        self.counters["lookup_requests"] += 1
                except KVXferError as exc:
                    self._mark_down(addr, exc)
                    first_absent = min(first_absent, pos[0])
            for addr, c, reqs in sent:  # every request is out: now the replies
                if c.closed:
                    first_absent = min([first_absent] + [part[0] for _, part in reqs])
                    continue
                try:
                    for rid, part in reqs:
                        bits = c.recv(rid, self.timeout)["present"]
                        j = bits.find("0") if len(bits) == len(part) else 0
                        if j >= 0:
                            first_absent = min(first_absent, part[j])
                except KVXferError as exc:
                    self._mark_down(addr, exc)
                    first_absent = min([first_absent] + [part[0] for _, part in reqs])
        finally:
            for _, c, _ in sent:
                c.lock.release()
        return first_absent

    def _lookup_conn(self, addr: str, pos: list, first_absent: int):
        """For a lookup: ``(connection, positions, first_absent)`` with ``addr``'s positions
        before ``first_absent`` (later keys cannot count). The connection is None when none
        is left to ask, or when the node cannot be reached (then it is marked down and its
        first position counts as absent)."""
        pos = pos[:bisect.bisect_left(pos, first_absent)]
        if not pos:
            return None, pos, first_absent
        try:
            return self._conn(addr), pos, first_absent
        except KVXferError as exc:
            self._mark_down(addr, exc)
            return None, pos, min(first_absent, pos[0])

    def _lookup_by_backend(self, keys: list, ask: list, first_absent: int):
        """The backend messages of :meth:`lookup` for the nodes ``ask`` (``[(address,
        positions)]``); returns the nodes still to ask on their sockets and the first
        position known absent."""
        posted, rest = [], []  # posted: (address, connection, positions, [(request, part)])
        for addr, pos in ask:
            c, pos, first_absent = self._lookup_conn(addr, pos, first_absent)
            if c is None:
                continue
            if not c.remote_lookups:
                rest.append((addr, pos))
                continue
            reqs: list = []
            try:
                for start in range(0, len(pos), LOOKUP_MAX_KEYS):
                    part = pos[start:start + LOOKUP_MAX_KEYS]
                    # (one node owning a whole chain, the common case: the keys as given)
                    asked = keys if len(part) == len(keys) else [keys[i] for i in part]
                    reqs.append((c.post_lookup(asked), part))
                    self.counters["lookup_backend_messages"] += 1
            except KVXferError as exc:
                self._drain_lookups(c, reqs)
                if c.closed:
                    self._mark_down(addr, exc)
                    first_absent = min(first_absent, pos[0])
                else:  # this connection carries no lookups
                    c.remote_lookups = False
                    rest.append((addr, pos))
                continue
            posted.append((addr, c, pos, reqs))
        for addr, c, pos, reqs in posted:
            absent, unknown = len(keys), False  # this node's first absent position; a key it cannot tell
            try:
                for k, (req, part) in enumerate(reqs):  # every answer is read, none left behind
                    codes = c.lookup_result(req, self.timeout)
                    n = codes.find(ABSENT)
                    unknown = unknown or UNKNOWN in (codes if n < 0 else codes[:n])
                    if n >= 0:
                        absent = min(absent, part[n])
            except InvalidDescriptor:  # the node answers no lookups this way
                self._drain_lookups(c, reqs[k + 1:])
                c.remote_lookups = False
                rest.append((addr, pos))
                continue
            except KVXferError as exc:
                self._mark_down(addr, exc)
                first_absent = min(first_absent, pos[0])
                continue
            if unknown:  # the node's table cannot tell: its socket can
                rest.append((addr, pos))
            else:
                first_absent = min(first_absent, absent)
        return rest, first_absent

    def _drain_lookups(self, c: NodeConn, reqs) -> None:
        """Wait out lookups ``reqs`` whose answers are not needed (so none is left behind)."""
        for req, _ in reqs:
            if c.closed:
                return
            try:
                c.lookup_result(req, self.timeout)
            except KVXferError:
                pass

    def _read_table(self, address: str, keys: list, pos: list):
        """``address``'s answer for ``keys[pos]`` from its key table, up to its first key
        not present (bytes of :data:`PRESENT` / :data:`ABSENT`), or None: ask the node (no
        connection yet, not on this host, the table stale, or a key it cannot tell)."""
        c = self._conns.get(address)  # (one dict read: atomic)
        if c is None or c.table is None:
            return None
        with c.mapped_lock:
            if not c.table_usable():
                return None
            codes = c.table.find(keys if len(pos) == len(keys) else itemgetter(*pos)(keys) if len(pos) > 1
                                 else (keys[pos[0]],))
        n = codes.find(ABSENT)  # answers past the first absent key are not needed
        if UNKNOWN in (codes if n < 0 else codes[:n]):
            return None
        self.counters["lookup_table_reads"] += 1
        return codes

    # ---- put / get -------------------------------------------------------------------
    def put(self, keys, layout, block_ids):
        """Put block ``block_ids[i]`` of ``layout`` (a host :class:`~kvxfer.KVLayout`) under
        ``keys[i]``; returns a :class:`~kvxfer.TransferHandle`, done once every object is
        committed (readable by any client) or was present already (a no-op that refreshes
        its recency). The blocks must not change until then. A key whose node is down,
        full, or being written by another client is skipped (counted in
        ``stats()["client"]["put_skipped"]``); a node that fails mid-put fails the handle.

        A rank of a TP group (``layout.head_range`` not every head) puts its **part** of
        each object: done once its part is committed; the object becomes readable when
        the parts of the group's ranks (each putting the same keys) cover every head. A
        key whose object is being assembled from parts that overlap this rank's heads
        without equalling them (another TP degree, or a wrong ``tp_rank``) is not put:
        once the rest is, the handle fails with :class:`~kvxfer.StorePartConflict`
        (``.keys``)."""
        keys, ids, fmt = self._args(keys, layout, block_ids)
        return self._submit("store_put", lambda done: self._do_put(keys, ids, fmt, done))

    def get(self, keys, layout, block_ids):
        """Load ``keys[i]`` into block ``block_ids[i]`` of ``layout`` (this rank's heads);
        returns a :class:`~kvxfer.TransferHandle`, done when every block holds its KV.
        If some key is missing, or its bytes fail the checksum (a miss, never wrong KV), or
        its node fails, the handle fails with :class:`~kvxfer.StoreMiss` (``.loaded``: the
        leading blocks that hold their KV; the rest are unspecified) or with the node's
        error (:class:`~kvxfer.PeerDisconnected`, :class:`~kvxfer.TransferTimeout`)."""
        keys, ids, fmt = self._args(keys, layout, block_ids)
        return self._submit("store_get", lambda done: self._do_get(keys, ids, fmt, done))

    def _args(self, keys, layout, block_ids):
        keys = check_keys(keys)
        fmt = self._format(layout)
        if fmt.nbytes > self._staging.numel():
            raise ValueError(f"an object of {fmt.nbytes} B does not fit the {self._staging.numel()}-byte staging buffer")
        ids = list(map(int, block_ids))
        if len(ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(ids)} block ids")
        if ids and (min(ids) < 0 or max(ids) >= layout.num_blocks):
            raise ValueError(f"block ids must be in [0, {layout.num_blocks})")
        return keys, ids, fmt

    def _submit(self, kind: str, fn):
        if self._closed:
            raise KVXferError("this KVStore is closed")
        done = HandleCompleter(kind, os.urandom(6).hex(), None)
        try:
            self._ops.put_nowait((fn, done))
        except queue.Full:
            raise LimitExceeded(f"{MAX_QUEUED_OPS} store operations are queued already") from None
        return done.handle

    def _work(self) -> None:
        while True:
            item = self._ops.get()
            if item is None:
                return
            fn, done = item
            if done.handle.done():  # cancelled while queued
                continue
            self._moved = 0
            done = OpReport(done, self.counters)  # sets handle.result as it ends
            try:
                fn(done)
            except KVXferError as exc:
                done.fail(exc)
            except Exception as exc:  # noqa: BLE001 - the caller sees it on its handle
                err = KVXferError(f"{done.handle.kind} failed: {exc!r}")
                err.__cause__ = exc
                done.fail(err)

    def _format(self, layout) -> ObjectFormat:
        """``ObjectFormat(layout)``, made once per layout (it memoizes block runs)."""
        with self._lock:
            got = self._formats.get(id(layout))
        if got is None or got.layout is not layout:
            got = ObjectFormat(layout)
            with self._lock:
                if len(self._formats) >= 64:
                    self._formats.clear()
                self._formats[id(layout)] = got
        return got

    def _pool_regions(self, fmt) -> list:
        """The backend region ids of ``fmt.layout``'s pool, registered on first use (the
        registration lasts until :meth:`close`; the pool must outlive this client)."""
        key = id(fmt.layout)
        got = self._pools.get(key)
        if got is None or got[0] is not fmt.layout:
            got = self._pools[key] = (fmt.layout, [self._backend.register(a, n) for a, n in fmt.layout.regions()])
        return got[1]

    def _batches(self, positions, nbytes: int, most: int = MAX_KEYS):
        per = min(max(1, self._staging.numel() // nbytes), most)
        for s in range(0, len(positions), per):
            yield positions[s:s + per]

    def _do_put(self, keys, ids, fmt, done) -> None:
        self.counters["puts"] += 1
        place = self._placement(self.replicas)
        targets: dict = {}
        for i, k in enumerate(keys):
            for addr in place.owners(k):
                targets.setdefault(addr, []).append(i)
        if not place.nodes:  # every node down: nothing is stored, and the result says so
            self.counters["put_skipped"] += len(keys)
            log.warning("store put of %d keys skipped: no store node is up", len(keys))
        conflicts: list = []
        used: list = []  # connections whose spares this put drew on
        try:
            for addr, pos in targets.items():
                try:
                    c = self._conn(addr)
                except KVXferError as exc:
                    self._mark_down(addr, exc)
                    self.counters["put_skipped"] += len(pos)
                    continue
                for batch in self._batches(pos, fmt.part_nbytes):
                    try:
                        with c.lock:
                            conflicts += self._put_batch(c, [keys[i] for i in batch], [ids[i] for i in batch], fmt)
                    except (PeerDisconnected, TransferTimeout) as exc:
                        self._mark_down(addr, exc)
                        raise
                if c.spares_wanted:
                    used.append(c)
            done.add_bytes(self._moved)
            if conflicts:
                self.counters["put_conflicts"] += len(conflicts)
                done.fail(StorePartConflict(f"{len(conflicts)} of {len(keys)} keys are being put in parts that "
                                            f"overlap heads {fmt.part} of {fmt.heads}", keys=conflicts))
                return
            done.succeed()
        finally:
            self._refill_spares(used)

    def _put_batch(self, c: NodeConn, keys, ids, fmt, *, spares: bool = True) -> list:
        """Put one batch on one node; return the keys refused with CONFLICT. Keys the node
        answered LIMIT (this client at its quota of reservations, :mod:`kvxfer.store.quotas`)
        are put again once the round's commits gave the quota back, while rounds store
        something (so a small node's quota makes a long put take several rounds)."""
        conflicts: list = []
        while True:
            more, limited, progress = self._put_round(c, keys, ids, fmt, spares=spares)
            conflicts += more
            if not limited:
                return conflicts
            if not progress:
                self.counters["put_skipped"] += len(limited)
                return conflicts
            keys, ids, spares = [keys[j] for j in limited], [ids[j] for j in limited], False

    def _put_round(self, c: NodeConn, keys, ids, fmt, *, spares: bool):
        """One round of :meth:`_put_batch`: ``(conflicts, limited, progress)``, the keys
        refused with CONFLICT, the positions answered LIMIT, and whether any key got a slot."""
        import numpy as np

        size, psize = fmt.nbytes, fmt.part_nbytes
        if size > c.slot_bytes:
            raise LimitExceeded(f"objects of {size} B exceed the largest store node {c.address} holds ({c.slot_bytes} B)")
        # whole objects to a node on this host: into spare slots, one round trip (COMMIT_SPARE)
        spared = spares and fmt.full and c.table is not None and c.spare_slots
        conflicts: list = []
        limited: list = []  # positions the node answered LIMIT
        if spared:
            got, present, rest = self._spares_for(c, keys, size)
            spared = c.spare_slots  # (a node that answers no SPARE: reserve and commit)
            if spared and rest:  # keys the node had no free spare for: reserved, as any put's
                conflicts += self._put_batch(c, [keys[j] for j in rest], [ids[j] for j in rest], fmt, spares=False)
        if spared:
            if not got:
                if present:
                    self._commit_spares(c, keys, got, present, [], size, fmt)
                return conflicts, [], False
        elif fmt.full:
            r = c.request(Req.RESERVE, {"keys": keys, "nbytes": size, "fmt": fmt.fmt}, self.timeout)["r"]
        else:
            r = c.request(Req.RESERVE_PART, {"keys": keys, "nbytes": size, "fmt": fmt.fmt,
                                             "heads": [*fmt.part, fmt.heads[1]]}, self.timeout)["r"]
        if not spared:
            got = [(j, off, tok) for j, (code, off, tok) in enumerate(r) if code == wire.RESERVED]
            conflicts = [keys[j] for j, (code, _, _) in enumerate(r) if code == wire.CONFLICT]
            self.counters["put_present"] += sum(1 for code, _, _ in r if code == wire.PRESENT)
            limited = [j for j, (code, _, _) in enumerate(r) if code == wire.LIMIT]
            self.counters["put_skipped"] += sum(1 for code, _, _ in r
                                                if code not in (wire.PRESENT, wire.RESERVED, wire.CONFLICT, wire.LIMIT))
            if not got:
                return conflicts, limited, False
        # same host with the slots mapped here: one native pass copies and hashes (below;
        # without checksums the same pass copies alone)
        fused = fmt.full and c.slots_local != 0
        if fused:
            _warm_copy_pool(len(got) * size)
        offs = [off for _, off, *_ in got]
        if not 0 <= min(offs) <= max(offs) <= c.region_bytes - size:
            raise KVXferError(f"store node {c.address} reserved a slot outside its region")
        # per object: its descriptors and the runs its checksum reads (the same bytes); or,
        # fused, the runs (local, offsets, lengths, counts) one native pass copies and hashes
        if fmt.put_zero_copy and fused:  # each run from its block to its place in the slot
            copy = _runs_into_slots(fmt, [ids[j] for j, *_ in got], offs)
        elif fmt.put_zero_copy:  # straight from the blocks into the slots
            blocks = [ids[j] for j, *_ in got]
            descs, _ = _descs_into_slots(fmt, self._pool_regions(fmt), blocks, offs, c.region)
            sums = [fmt.run_arrays(b)[::2] for b in blocks]
        elif fmt.full:  # each object packed in staging, whole
            for n, (j, *_) in enumerate(got):
                fmt.pack_one(ids[j], self._staging[n * size:(n + 1) * size])
            within = np.arange(len(got), dtype=np.int64) * size
            if fused:
                copy = (self._stage_ptr + within, np.asarray(offs, np.int64), np.full(len(got), size, np.int64),
                        [1] * len(got))
            else:
                descs = self._staged_descs(c, offs, size)
                sums = [([self._stage_ptr + w], [size]) for w in within.tolist()]
        else:  # a part packed into staging, then one descriptor per row of the object
            rows, sums = [], []
            within = np.arange(fmt.num_rows, dtype=np.int64) * fmt.part_row
            dst = fmt.rows(*fmt.part)
            for n, (j, off, *_) in enumerate(got):
                fmt.pack_one(ids[j], self._staging[n * psize:(n + 1) * psize])
                rows.append(np.stack([np.full(fmt.num_rows, self._stage_region, np.int64), n * psize + within,
                                      np.full(fmt.num_rows, c.region, np.int64), off + dst,
                                      np.full(fmt.num_rows, fmt.part_row, np.int64)], axis=1))
                sums.append(([self._stage_ptr + n * psize], [psize]))
            descs = np.concatenate(rows)
        # elsewhere the checksums read the source while the copy does (both native, GIL released)
        hashing = self._hasher.submit(_checksums, sums) if self.checksum and not fused else None
        try:
            if fused:  # same host, slots mapped here: one pass copies and hashes each object
                crcs = self._copy_hashing(c, *copy, into=False)
            else:
                c.move("write", descs, self.timeout)
                crcs = hashing.result() if hashing is not None else [NO_CRC] * len(got)
        except KVXferError:
            if hashing is not None:
                hashing.result()
            if not c.closed:
                self._give_back(c, keys, got, spared)
            raise
        self._commit(c, keys, got, present if spared else None, crcs, size, psize, fmt, conflicts)
        return conflicts, limited, True

    def _staged_descs(self, c: NodeConn, slot_offsets, size: int):
        """int64 ``[n, 5]`` descriptors moving whole objects of ``size`` bytes between
        staging (object ``i`` at ``i * size``) and the slots at ``slot_offsets`` of ``c``."""
        import numpy as np

        n = len(slot_offsets)
        return np.stack([np.full(n, self._stage_region, np.int64), np.arange(n, dtype=np.int64) * size,
                         np.full(n, c.region, np.int64), np.asarray(slot_offsets, np.int64),
                         np.full(n, size, np.int64)], axis=1)

    def _give_back(self, c: NodeConn, keys, got, spared: bool) -> None:
        """After a failed write: spares stay this connection's (what they hold is overwritten
        later); reservations are aborted."""
        if spared:
            c.spares += [(off, tok, use_by) for _, off, tok, use_by in got]
        else:
            c.request(Req.ABORT, {"keys": [keys[j] for j, _, _ in got], "tokens": [t for _, _, t in got]},
                      self.timeout)

    def _commit(self, c: NodeConn, keys, got, present, crcs, size: int, psize: int, fmt, conflicts) -> list:
        """Commit the written objects ``got`` (into spares where ``present`` is a list, the
        positions the key table showed present; else their reservations); return
        ``conflicts``."""
        self._moved += len(got) * psize
        if present is not None:
            self._commit_spares(c, keys, got, present, crcs, size, fmt)
            return conflicts
        ok = c.request(Req.COMMIT, {"keys": [keys[j] for j, _, _ in got], "tokens": [t for _, _, t in got],
                                    "crcs": crcs}, self.timeout)["ok"]
        self.counters["put_objects"] += sum(1 for x in ok if x)
        self.counters["put_skipped"] += sum(1 for x in ok if not x)
        return conflicts

    def _spares_for(self, c: NodeConn, keys, size: int):
        """For a put of whole objects on a node on this host: ``(got, present, rest)``.
        ``present``: the positions the node's key table shows present (none when it
        cannot be read now); ``got``: ``[(position, offset, token, use_by)]``, a spare slot
        for each other key, from those the connection holds, then from a SPARE request for
        the rest (unless the node's last answer had no free chunks: a spare never costs
        an object); ``rest``: the positions left without a spare (to reserve)."""
        with c.mapped_lock:
            codes = c.table.find(keys) if c.table_usable() else b""
        present = [j for j, code in enumerate(codes) if code == PRESENT]
        c.spares_of(size)
        want = [j for j in range(len(keys)) if not codes or codes[j] != PRESENT]
        now = time.monotonic()
        c.spares = [sp for sp in c.spares if sp[2] > now]  # past use_by: left to lapse on the node
        if len(c.spares) < len(want) and not c.spares_dry:  # free chunks only: the rest are reserved
            self._ask_spares(c, len(want) - len(c.spares), evict=False)
            if not c.spare_slots:
                return [], [], []
        take, c.spares = c.spares[:len(want)], c.spares[len(want):]
        got = [(j, off, tok, use_by) for j, (off, tok, use_by) in zip(want, take)]
        c.spares_wanted = min(SPARES_HELD, len(want), c.num_slots // 16)
        return got, present, want[len(got):]

    def _ask_spares(self, c: NodeConn, count: int, *, evict: bool) -> None:
        """Ask the node for ``count`` more spare slots (it may give fewer; ``evict``: as
        for a reserve, else free ones only); each is used within half its lease (so never
        after the node took it back)."""
        sent = time.monotonic()
        try:
            r = c.request(Req.SPARE, {"count": count, "evict": evict, "nbytes": c.spare_nbytes}, self.timeout)
        except NodeError as exc:
            if exc.code != "bad_request":
                raise
            c.spare_slots = False  # a node that knows no spare slots: puts reserve, then commit
            log.info("store node %s keeps no spare slots (%s): puts reserve and commit", c.address, exc)
            return
        use_by = sent + float(r.get("lease_s", 0)) / 2
        c.spares_dry = len(r["s"]) < count
        for off, tok in r["s"]:
            if not 0 <= off <= c.region_bytes - c.spare_nbytes:
                raise KVXferError(f"store node {c.address} named a spare slot outside its region")
            c.spares.append((off, tok, use_by))

    def _commit_spares(self, c: NodeConn, keys, got, present, crcs, size: int, fmt) -> None:
        """COMMIT_SPARE the objects written into spares (``got``, their ``crcs``) and the
        keys seen ``present`` (token 0: refreshed); spares whose key was present or busy
        go back to the connection."""
        order = [j for j, *_ in got] + present
        r = c.request(Req.COMMIT_SPARE, {"keys": [keys[j] for j in order],
                                         "tokens": [g[2] for g in got] + [0] * len(present),
                                         "crcs": list(crcs) + [0] * len(present), "nbytes": size, "fmt": fmt.fmt},
                      self.timeout)["r"]
        if len(r) != len(order):
            raise KVXferError(f"store node {c.address} answered {len(r)} of {len(order)} commits")
        for n, code in enumerate(r):
            if code == wire.COMMITTED:
                self.counters["put_objects"] += 1
            elif code == wire.PRESENT:
                self.counters["put_present"] += 1
            else:
                self.counters["put_skipped"] += 1
            if n < len(got) and code in (wire.PRESENT, wire.BUSY, wire.REFUSED):
                c.spares.append(got[n][1:])

    def _refill_spares(self, conns) -> None:
        """After a put: top the spares of ``conns`` up to what each last put wrote, from the
        nodes' free slots (off the put's critical path: its handle is done). A node that
        fails here is marked down."""
        for c in conns:
            with c.lock:
                n = c.spares_wanted - len(c.spares)
                if n <= 0 or c.closed or not c.spare_slots:
                    continue
                try:
                    self._ask_spares(c, n, evict=False)  # ahead of need: never at an object's cost
                except KVXferError as exc:  # gone, late, or an answer that makes no sense
                    self._mark_down(c.address, exc)

    def _do_get(self, keys, ids, fmt, done) -> None:
        self.counters["gets"] += 1
        good = [False] * len(keys)
        failure: BaseException | None = None
        size = fmt.nbytes
        for addr, pos in self._route(keys).items():
            try:
                c = self._conn(addr)
            except KVXferError as exc:
                self._mark_down(addr, exc)
                failure = failure or exc
                continue
            for batch in self._batches(pos, fmt.nbytes, MAX_GET_KEYS):
                try:
                    with c.lock:
                        reply = c.request(Req.GET, {"keys": [keys[i] for i in batch], "fmt": fmt.fmt}, self.timeout)
                        r = reply["r"]
                        self.counters["get_disk_objects"] += reply.get("disk", 0)  # read back from its disk tier
                        pinned = [(i, off, nb, crc, pin) for i, (off, nb, crc, pin) in zip(batch, r) if pin > 0]
                        hits, bad, refused = self._screen(c, pinned, size)
                        try:
                            if hits:
                                ok = self._read_hits(c, fmt, hits, ids, bad)
                                for i in ok:
                                    good[i] = True
                                self._moved += len(hits) * size
                        finally:
                            if pinned and not c.closed:
                                c.send(Req.RELEASE, {"pins": [h[4] for h in pinned], "bad": bad}, reply=False)
                        self.counters["checksum_failures"] += len(bad)
                        self.counters["unverified_refused"] += refused
                except (PeerDisconnected, TransferTimeout) as exc:
                    self._mark_down(addr, exc)
                    failure = failure or exc
                    break
        loaded = 0
        while loaded < len(keys) and good[loaded]:
            loaded += 1
        self.counters["get_objects"] += sum(good)
        self.counters["get_misses"] += len(keys) - sum(good)
        done.add_bytes(self._moved)
        if loaded == len(keys):
            done.succeed()
            return
        if failure is not None and not isinstance(failure, StoreMiss):
            failure.loaded = loaded
            done.fail(failure)
            return
        done.fail(StoreMiss(f"{len(keys) - loaded} of {len(keys)} keys not loaded from the pool "
                            f"(first at position {loaded})", loaded=loaded))

    def _screen(self, c: NodeConn, pinned, size: int):
        """Before reading a GET's hits ``pinned`` (``[(position, offset, nbytes, crc, pin)]``):
        ``(hits, bad, refused)``. An object the node names with another size than this
        format's, or outside its region, is bad (its pin goes in ``bad``: the node drops it,
        and its key misses); with checksums on, an object put without one (``NO_CRC``) is
        refused, unread (a miss, counted in ``refused``; the object stays for readers
        that check nothing)."""
        hits, bad, refused = [], [], 0
        for h in pinned:
            _, off, nb, crc, pin = h
            if nb != size or isinstance(off, bool) or not isinstance(off, int) or not 0 <= off <= c.region_bytes - size:
                log.warning("store node %s named an object of %s B at %s for a format of %d B: dropped",
                            c.address, nb, off, size)
                bad.append(pin)
            elif self.checksum and (crc == NO_CRC or isinstance(crc, list)
                                    and any(isinstance(p, list) and len(p) == 3 and p[2] == NO_CRC for p in crc)):
                refused += 1
            else:
                hits.append(h)
        return hits, bad, refused

    def _copy_hashing(self, c: NodeConn, local, offsets, lengths, counts, *, into: bool) -> list:
        """Copy objects between this process's memory and the node's slots mapped here,
        hashing the local side as it goes (native, one read of each byte; a batch of the
        vm path's split size or more spread over its copy threads, whole objects each);
        return each object's checksum (``checksum=False``: the copies alone, each ``NO_CRC``).
        ``local`` / ``offsets`` / ``lengths``: int64 ``[num_runs]``, each run's address
        here, offset in the node's region and length; ``counts``: runs per object, in
        order. ``into``: slots -> local, else local -> slots. The offsets are
        checked against the region; the mapping stays while ``c.mapped_lock`` is held."""
        import numpy as np

        offsets, lengths = np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)
        if len(offsets) and (offsets.min() < 0 or (offsets + lengths).max() > c.region_bytes):
            raise KVXferError(f"store node {c.address}: a run outside its region")
        with c.mapped_lock:
            if c.slots_local == 0:
                raise PeerDisconnected(f"store node {c.address} connection is closed")
            sums = load().copy_checksum_objects(np.asarray(local, np.int64), c.slots_local + offsets, lengths,
                                                np.asarray(counts, np.int64), into, hash=self.checksum)
        return sums if self.checksum else [NO_CRC] * len(sums)

    def _read_hits(self, c: NodeConn, fmt, hits, ids, bad: list) -> list:
        """Read pinned objects ``hits`` (``[(position, offset, nbytes, crc, pin)]``) into
        their blocks; return the positions whose bytes passed the checksum (the pins of
        the others go to ``bad``). Reads go in pieces (:data:`READ_PIECES`,
        :data:`READ_PIECE_BYTES`), each piece's checksums computed while the next ones move."""
        import numpy as np

        size = fmt.nbytes
        checks = crcs = None  # crcs: same host, each object's one checksum (None: malformed)
        whole_here = c.slots_local != 0 and all(type(h[3]) is int for h in hits)  # all put whole: the common case
        if not self.checksum:  # nothing to check (on this host the one pass copies alone)
            crcs = [NO_CRC] * len(hits) if whole_here else None
        elif whole_here:
            crcs = [crc if 0 <= crc < 2**64 else None for _, _, _, crc, _ in hits]
        else:
            checks = ([fmt.checks(crc, block_id=ids[i]) for i, _, _, crc, _ in hits] if fmt.zero_copy else
                      [fmt.checks(h[3], base=self._stage_ptr + n * size) for n, h in enumerate(hits)])
            if c.slots_local != 0 and all(len(ch) == 1 for ch in checks if ch):
                crcs = [ch[0][2] if ch else None for ch in checks]
        if crcs is not None:  # same host, slots mapped here: one pass copies each object and hashes what arrived
            _warm_copy_pool(len(hits) * size)
            verdict = self._read_hashing(c, fmt, hits, ids, crcs)
        else:  # one-sided reads, descriptors per run (straight into the blocks) or per object
            offs = [off for _, off, *_ in hits]
            if fmt.zero_copy:
                descs, ends = _descs_into_slots(fmt, self._pool_regions(fmt), [ids[h[0]] for h in hits], offs,
                                                c.region)
            else:
                descs, ends = self._staged_descs(c, offs, size), np.arange(1, len(hits) + 1)
            verdict = [True] * len(hits)
            step = max(1, min(-(-len(hits) // READ_PIECES), READ_PIECE_BYTES // size))
            # every piece in flight at once (the link stays busy); checked in order as each lands
            posted = []
            for first in range(0, len(hits), step):
                lo, hi = ends[first - 1] if first else 0, ends[min(first + step, len(hits)) - 1]
                posted.append((first, c.post("read", descs[lo:hi])))
            pending = None  # (first, future) of the piece being checked
            for first, req in posted:
                c.wait(req, self.timeout)
                if pending is not None:
                    self._collect(pending, verdict)
                if checks is not None:
                    pending = (first, self._hasher.submit(_verify, checks[first:first + step]))
            if pending is not None:
                self._collect(pending, verdict)
        good = []
        for n, ((i, *_, pin), fine) in enumerate(zip(hits, verdict)):
            if fine:
                good.append((n, i))
            else:
                bad.append(pin)
        if not fmt.zero_copy:
            self._unpack_runs(fmt, good, ids)
        return [i for _, i in good]

    def _read_hashing(self, c: NodeConn, fmt, hits, ids, crcs) -> list:
        """The reads of :meth:`_read_hits` for whole-object checksums ``crcs`` (one per hit,
        None: malformed, bad, nothing copied; ``NO_CRC``: not checked) from slots mapped
        here: each object is copied into its blocks (zero-copy) or staging and hashed there
        in the same pass (``checksum=False``: copied alone); returns per hit whether its
        bytes passed the checksum."""
        import numpy as np

        wanted = [n for n, crc in enumerate(crcs) if crc is not None]
        verdict = [False] * len(hits)
        if not wanted:
            return verdict
        offs = [hits[n][1] for n in wanted]
        if fmt.zero_copy:  # each run from its place in the slot to its block
            copy = _runs_into_slots(fmt, [ids[hits[n][0]] for n in wanted], offs)
        else:  # whole, into staging
            size = fmt.nbytes
            copy = (self._stage_ptr + np.asarray(wanted, np.int64) * size, np.asarray(offs, np.int64),
                    np.full(len(wanted), size, np.int64), [1] * len(wanted))
        for n, got in zip(wanted, self._copy_hashing(c, *copy, into=True)):
            verdict[n] = crcs[n] == NO_CRC or got == crcs[n]
        return verdict

    @staticmethod
    def _collect(pending, verdict) -> None:
        first, fut = pending
        for k, fine in enumerate(fut.result()):
            verdict[first + k] = fine

    def _unpack_runs(self, fmt, ok, ids) -> None:
        """Unpack the verified objects ``ok`` (``[(staging slot n, key position i)]``):
        consecutive staging slots in one call."""
        size = fmt.nbytes
        s = 0
        while s < len(ok):
            e = s + 1
            while e < len(ok) and ok[e][0] == ok[e - 1][0] + 1:
                e += 1
            n0 = ok[s][0]
            fmt.unpack_many(self._staging[n0 * size:], [ids[i] for _, i in ok[s:e]])
            s = e

    # ---- stats / lifecycle -------------------------------------------------------------
    def stats(self) -> dict:
        """The pool's counters summed over the live nodes (``hits``, ``misses``,
        ``evictions``, ``bytes_used``, ``capacity_bytes``, ``objects``, ..., and per tier:
        :data:`~kvxfer.store.tiers.TIER_COUNTS`), ``nodes``
        (reachable now), ``nodes_down``, ``per_node`` (each node's own), and ``client``
        (this client's: puts, objects put/present/skipped, part conflicts, gets, misses,
        checksum failures)."""
        total = {k: 0 for k in ("hits", "misses", "evictions", "bytes_used", "capacity_bytes", "objects",
                                "pending", "spares", "pins", "bad_objects", *TIER_COUNTS)}
        per_node = {}
        for addr in self._live():
            try:
                c = self._conn(addr)
                with c.lock:
                    s = c.request(Req.STATS, {}, self.timeout)
            except KVXferError as exc:
                self._mark_down(addr, exc)
                continue
            s.pop("id", None)
            per_node[addr] = s
            for k in total:
                total[k] += int(s.get(k, 0))
        with self._lock:
            known = len(self._members)
        return {**total, "nodes": len(per_node), "nodes_down": known - len(per_node), "per_node": per_node,
                "client": dict(self.counters)}

    def close(self) -> None:
        """Fail queued operations, stop the worker, disconnect every node, release the staging
        buffer; idempotent."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                item = self._ops.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].fail(KVXferError("KVStore closed"))
        self._ops.put(None)
        self._worker.join(self.timeout * 4 + 5)
        self._hasher.shutdown(wait=True)
        if self._watch is not None:
            self._watch.stop()
        if self._discovery is not None:
            self._discovery.close()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()
        self._backend.close()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        nodes = self.nodes()
        up = sum(1 for v in nodes.values() if v == "up")
        return f"<KVStore {up}/{len(nodes)} nodes up replicas={self.replicas}{' closed' if self._closed else ''}>"


def _descs_into_slots(fmt, regions, block_ids, slot_offsets, region: int):
    """``(descs, ends)`` for one-sided moves of whole objects straight between blocks
    ``block_ids`` of ``fmt``'s pool (backend region ids ``regions``, one per pool region)
    and the slots at ``slot_offsets`` of the node's region ``region``: int64
    ``[num_runs, 5]`` descriptors (local region, offset, remote region, offset, length),
    object after object, and where each object's runs end (int64 ``[len(block_ids)]``)."""
    import numpy as np

    runs = [fmt.runs(b) for b in block_ids]
    ends = np.cumsum([len(r) for r in runs])
    runs = np.concatenate(runs)
    descs = np.empty((len(runs), 5), np.int64)
    descs[:, 0] = np.asarray(regions, np.int64)[runs[:, 0]]
    descs[:, 1] = runs[:, 1]
    descs[:, 2] = region
    descs[:, 3] = runs[:, 2] + np.repeat(np.asarray(slot_offsets, np.int64), np.diff(ends, prepend=0))
    descs[:, 4] = runs[:, 3]
    return descs, ends


def _runs_into_slots(fmt, block_ids, slot_offsets):
    """``(local, offsets, lengths, counts)`` for :meth:`KVStore._copy_hashing` of whole
    objects straight between blocks ``block_ids`` of ``fmt``'s pool and the slots at
    ``slot_offsets`` (a zero-copy layout): every run's address in the pool, offset in the
    node's region and length (int64 ``[num_runs]``), and the runs of each object."""
    import numpy as np

    arrays = [fmt.run_arrays(b) for b in block_ids]
    counts = [len(a) for a, _, _ in arrays]
    offsets = np.concatenate([w for _, w, _ in arrays])
    offsets += np.repeat(np.asarray(slot_offsets, np.int64), counts)
    return (np.concatenate([a for a, _, _ in arrays]), offsets, np.concatenate([n for _, _, n in arrays]), counts)


# how long the copy pool's helpers wait spinning for a copy that is about to come (the
# Python between here and the copy takes 0.05-0.3 ms)
_WARM_US = 500


def _warm_copy_pool(nbytes: int) -> None:
    """A copy of ``nbytes`` is about to run through :meth:`KVStore._copy_hashing`: where it is
    large enough to go to the same-host copy pool, wake its helpers now, so that they
    start with the calling thread rather than tens of microseconds later."""
    c = load()
    if nbytes >= c.VM_SPLIT_BYTES:
        c.warm_copy_pool(_WARM_US)
