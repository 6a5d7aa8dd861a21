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

``KVStore`` is the facade; what it does lives in modules named for it: which nodes there
are and where a key lives (:mod:`~kvxfer.store.members`), lookups
(:mod:`~kvxfer.store.lookup`), how bytes move between blocks and slots, for puts and gets
alike (:mod:`~kvxfer.store.copies`), spare slots (:mod:`~kvxfer.store.spares`); here are
the operations' steps: batches, reserve or spares, commit, the get's pins and checks.
"""
from __future__ import annotations

import logging
import os
import queue
import threading

from ..errors import KVXferError, LimitExceeded, PeerDisconnected, StoreMiss, StorePartConflict, TransferTimeout
from ..handle import HandleCompleter
from ..secrets import normalize_secret
from . import protocol as wire
from .conn import NodeConn
from .copies import Copier, descs_into_slots, runs_into_slots, warm_copy_pool
from .key_table import PRESENT
from .keys import check_keys
from .lookup import Lookup
from .members import Members, check_address
from .objects import ObjectFormat
from .spares import Spares
from .protocol import MAX_KEYS, NO_CRC, Req
from .results import OpReport
from .tiers import TIER_COUNTS

log = logging.getLogger("kvxfer.store")

__all__ = ["KVStore"]

MAX_QUEUED_OPS = 1024
# keys per GET: a node answers at most MAX_REPLY_PARTS checksums per reply (the rest miss),
# so objects of up to 16 parts (TP degree 16) always fit
MAX_GET_KEYS = 1024


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
        from ..transport import make_backend

        if (nodes is None) == (discovery is None):
            raise ValueError("give exactly one of nodes=[...] or discovery='etcd://...'")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        secret = normalize_secret(secret)
        self.replicas, self.timeout, self.retry_s = replicas, float(timeout), float(retry_s)
        self.checksum = bool(checksum)
        self._lock = threading.Lock()
        self.client_id = os.urandom(16).hex()  # this client's identity for the nodes' quotas, over reconnects
        self._formats: dict[int, ObjectFormat] = {}
        self._watch = self._discovery = None
        if nodes is not None:
            if isinstance(nodes, str):
                nodes = [nodes]
            nodes = sorted({check_address(a) for a in nodes})
            if not nodes:
                raise ValueError("nodes must name at least one HOST:PORT")
        self.counters = {"puts": 0, "put_objects": 0, "put_present": 0, "put_skipped": 0, "put_conflicts": 0, "gets": 0,
                         "get_objects": 0, "get_disk_objects": 0, "get_misses": 0, "checksum_failures": 0,
                         "node_failures": 0, "auth_failures": 0, "unverified_refused": 0,
                         "lookup_table_reads": 0, "lookup_requests": 0, "lookup_backend_messages": 0}
        self._backend = make_backend(backend)
        self._nodes = Members(secret, self._backend, timeout=self.timeout, retry_s=self.retry_s,
                              counters=self.counters, client_id=self.client_id)
        if nodes is not None:
            self._nodes.set(nodes)
        self._lookup = Lookup(self._nodes, self.counters, self.timeout)
        self._copier = Copier(self._backend, staging_bytes, checksum=self.checksum, timeout=self.timeout)
        self._spares = Spares(self._nodes, self.counters, self.timeout)
        self._ops: queue.Queue = queue.Queue(MAX_QUEUED_OPS)
        self._closed = False
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
            self._nodes.set(store_addresses(members))
            first.set()

        self._watch = disc.watch(on_change)
        first.wait(self.timeout + 3.0)  # the first view (or none, if etcd is unreachable: no nodes yet)

    # ---- lookup ----------------------------------------------------------------------
    def nodes(self) -> dict:
        """``{address: "up" | "down"}`` for every known node."""
        return self._nodes.nodes()

    @property
    def _conns(self) -> dict:
        """``{address: NodeConn}``: this client's connections now."""
        return self._nodes.conns

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, keys) -> int:
        """How many leading ``keys`` (bytes, 1..64 each) are in the pool now.

        A node on this host is answered from its key table in shared memory (no request;
        :mod:`kvxfer.store.key_table`), unless the table is stale or cannot tell. Every
        other node that owns one of the keys before the first one known absent gets one
        message through the backend, which the node's backend answers from the same table
        in its progress (csrc/remote_lookup.cpp); a node that cannot tell, or answers no
        such message, gets a request on its socket. Messages and requests are all in
        flight at once. A node that fails counts its keys as absent (and is marked down);
        with no node up, nothing is present (:mod:`kvxfer.store.lookup`)."""
        return self._lookup(keys)

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
        if fmt.nbytes > self._copier.staging.numel():
            raise ValueError(f"an object of {fmt.nbytes} B does not fit the {self._copier.staging.numel()}-byte staging buffer")
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
            self._copier.moved = 0
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

    def _batches(self, positions, nbytes: int, most: int = MAX_KEYS):
        per = min(max(1, self._copier.staging.numel() // nbytes), most)
        for s in range(0, len(positions), per):
            yield positions[s:s + per]

    def _do_put(self, keys, ids, fmt, done) -> None:
        self.counters["puts"] += 1
        place = self._nodes.placement(self.replicas)
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
                    c = self._nodes.conn(addr)
                except KVXferError as exc:
                    self._nodes.mark_down(addr, exc)
                    self.counters["put_skipped"] += len(pos)
                    continue
                for batch in self._batches(pos, fmt.part_nbytes):
                    try:
                        with c.lock:
                            conflicts += self._put_batch(c, [keys[i] for i in batch], [ids[i] for i in batch], fmt)
                    except (PeerDisconnected, TransferTimeout) as exc:
                        self._nodes.mark_down(addr, exc)
                        raise
                if c.spares_wanted:
                    used.append(c)
            done.add_bytes(self._copier.moved)
            if conflicts:
                self.counters["put_conflicts"] += len(conflicts)
                done.fail(StorePartConflict(f"{len(conflicts)} of {len(keys)} keys are being put in parts that "
                                            f"overlap heads {fmt.part} of {fmt.heads}", keys=conflicts))
                return
            done.succeed()
        finally:
            self._spares.refill(used)

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
            got, present, rest = self._spares.for_put(c, keys, size)
            spared = c.spare_slots  # (a node that answers no SPARE: reserve and commit)
            if spared and rest:  # keys the node had no free spare for: reserved, as any put's
                conflicts += self._put_batch(c, [keys[j] for j in rest], [ids[j] for j in rest], fmt, spares=False)
        if spared:
            if not got:
                if present:
                    self._spares.commit(c, keys, got, present, [], size, fmt)
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
            warm_copy_pool(len(got) * size)
        offs = [off for _, off, *_ in got]
        if not 0 <= min(offs) <= max(offs) <= c.region_bytes - size:
            raise KVXferError(f"store node {c.address} reserved a slot outside its region")
        # per object: its descriptors and the runs its checksum reads (the same bytes); or,
        # fused, the runs (local, offsets, lengths, counts) one native pass copies and hashes
        if fmt.put_zero_copy and fused:  # each run from its block to its place in the slot
            copy = runs_into_slots(fmt, [ids[j] for j, *_ in got], offs)
        elif fmt.put_zero_copy:  # straight from the blocks into the slots
            blocks = [ids[j] for j, *_ in got]
            descs, _ = descs_into_slots(fmt, self._copier.pool_regions(fmt), blocks, offs, c.region)
            sums = [fmt.run_arrays(b)[::2] for b in blocks]
        elif fmt.full:  # each object packed in staging, whole
            for n, (j, *_) in enumerate(got):
                fmt.pack_one(ids[j], self._copier.staging[n * size:(n + 1) * size])
            within = np.arange(len(got), dtype=np.int64) * size
            if fused:
                copy = (self._copier.stage_ptr + within, np.asarray(offs, np.int64), np.full(len(got), size, np.int64),
                        [1] * len(got))
            else:
                descs = self._copier.staged_descs(c, offs, size)
                sums = [([self._copier.stage_ptr + w], [size]) for w in within.tolist()]
        else:  # a part packed into staging, then one descriptor per row of the object
            rows, sums = [], []
            within = np.arange(fmt.num_rows, dtype=np.int64) * fmt.part_row
            dst = fmt.rows(*fmt.part)
            for n, (j, off, *_) in enumerate(got):
                fmt.pack_one(ids[j], self._copier.staging[n * psize:(n + 1) * psize])
                rows.append(np.stack([np.full(fmt.num_rows, self._copier.stage_region, np.int64), n * psize + within,
                                      np.full(fmt.num_rows, c.region, np.int64), off + dst,
                                      np.full(fmt.num_rows, fmt.part_row, np.int64)], axis=1))
                sums.append(([self._copier.stage_ptr + n * psize], [psize]))
            descs = np.concatenate(rows)
        # elsewhere the checksums read the source while the copy does (both native, GIL released)
        hashing = self._copier.checksums_of(sums) if self.checksum and not fused else None
        try:
            if fused:  # same host, slots mapped here: one pass copies and hashes each object
                crcs = self._copier.copy_hashing(c, *copy, into=False)
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
        self._copier.moved += len(got) * psize
        if present is not None:
            self._spares.commit(c, keys, got, present, crcs, size, fmt)
            return conflicts
        ok = c.request(Req.COMMIT, {"keys": [keys[j] for j, _, _ in got], "tokens": [t for _, _, t in got],
                                    "crcs": crcs}, self.timeout)["ok"]
        self.counters["put_objects"] += sum(1 for x in ok if x)
        self.counters["put_skipped"] += sum(1 for x in ok if not x)
        return conflicts

    def _do_get(self, keys, ids, fmt, done) -> None:
        self.counters["gets"] += 1
        good = [False] * len(keys)
        failure: BaseException | None = None
        size = fmt.nbytes
        for addr, pos in self._nodes.route(keys).items():
            try:
                c = self._nodes.conn(addr)
            except KVXferError as exc:
                self._nodes.mark_down(addr, exc)
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
                                ok = self._copier.read_hits(c, fmt, hits, ids, bad)
                                for i in ok:
                                    good[i] = True
                                self._copier.moved += len(hits) * size
                        finally:
                            if pinned and not c.closed:
                                c.send(Req.RELEASE, {"pins": [h[4] for h in pinned], "bad": bad}, reply=False)
                        self.counters["checksum_failures"] += len(bad)
                        self.counters["unverified_refused"] += refused
                except (PeerDisconnected, TransferTimeout) as exc:
                    self._nodes.mark_down(addr, exc)
                    failure = failure or exc
                    break
        loaded = 0
        while loaded < len(keys) and good[loaded]:
            loaded += 1
        self.counters["get_objects"] += sum(good)
        self.counters["get_misses"] += len(keys) - sum(good)
        done.add_bytes(self._copier.moved)
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
        for addr in self._nodes.live():
            try:
                c = self._nodes.conn(addr)
                with c.lock:
                    s = c.request(Req.STATS, {}, self.timeout)
            except KVXferError as exc:
                self._nodes.mark_down(addr, exc)
                continue
            s.pop("id", None)
            per_node[addr] = s
            for k in total:
                total[k] += int(s.get(k, 0))
        known = self._nodes.known()
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
        self._copier.close()
        if self._watch is not None:
            self._watch.stop()
        if self._discovery is not None:
            self._discovery.close()
        self._nodes.close()
        self._backend.close()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        nodes = self.nodes()
        up = sum(1 for v in nodes.values() if v == "up")
        return f"<KVStore {up}/{len(nodes)} nodes up replicas={self.replicas}{' closed' if self._closed else ''}>"

