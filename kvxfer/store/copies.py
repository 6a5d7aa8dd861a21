"""How a store client's bytes move between an engine's blocks and a node's slots.

Both directions (a put writes, a get reads) take one of the same routes, picked per
batch from where the node is and what the layout allows (:class:`~kvxfer.store.objects.ObjectFormat`):

==============================  =========================================================
route                           when
==============================  =========================================================
one pass, straight              same host (slots mapped here), a layout whose runs are long
                                (``zero_copy``): each run copied between its block and its
                                place in the slot, the checksum computed in the same pass
one pass, staged                same host, short runs: whole objects between staging and
                                slots, hashed in the same pass; ``pack``/``unpack`` at staging
one-sided, straight             another host, long runs: one descriptor per run, straight
                                between the registered pool and the slot
one-sided, staged               another host, short runs (or a TP rank's get): whole objects
                                through registered staging, one descriptor per object
one-sided, rows                 a TP rank's put: its heads of each row, one descriptor per row
==============================  =========================================================

Elsewhere than in one pass, the checksums are computed on a hasher thread while the
bytes move (native, GIL released). A :class:`Copier` holds what the routes share: the
registered staging buffer, the hasher, the registrations of the engines' pools.
"""
from __future__ import annotations

from .._native import load
from ..errors import KVXferError, PeerDisconnected
from .conn import NodeConn
from .objects import checksum
from .protocol import NO_CRC

__all__ = ["Copier", "READ_PIECES", "READ_PIECE_BYTES", "descs_into_slots", "runs_into_slots", "warm_copy_pool"]

# a get's reads per node batch go in at least READ_PIECES pieces of at most READ_PIECE_BYTES
# (but whole objects), each checked while the next ones move: a small piece is still in
# cache when its checksum reads it
READ_PIECES = 8
READ_PIECE_BYTES = 4 << 20


class Copier:
    """The routes' shared state for one client: ``staging`` (uint8 ``[staging_bytes]``, registered
    with ``backend``), the hasher thread, the engines' pools registered on first use.
    ``checksum``: compute and check checksums (else every object's is ``NO_CRC``).
    ``moved``: bytes the running operation moved (its caller resets it)."""

    def __init__(self, backend, staging_bytes: int, *, checksum: bool, timeout: float) -> None:
        import kvxfer
        from concurrent.futures import ThreadPoolExecutor

        self._backend, self.checksum, self.timeout = backend, checksum, timeout
        self.staging = kvxfer.shared_empty(int(staging_bytes))  # uint8 [staging_bytes]
        self.stage_ptr = self.staging.data_ptr()
        self.stage_region = backend.register_tensor(self.staging)
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="kvxfer-store-checksum")
        self._pools: dict[int, tuple] = {}  # id(layout) -> (layout, backend region ids)
        self.moved = 0

    def close(self) -> None:
        self.hasher.shutdown(wait=True)

    def checksums_of(self, sums):
        """A future of the checksums of ``sums`` (``[(addrs, lengths)]``), on the hasher thread."""
        return self.hasher.submit(_checksums, sums)

    def pool_regions(self, fmt) -> list:
        """The backend region ids of ``fmt.layout``'s pool, registered on first use (the
        registration lasts until :meth:`close`; the pool must outlive this client)."""
        key = id(fmt.layout)
        got = self._pools.get(key)
        if got is None or got[0] is not fmt.layout:
            got = self._pools[key] = (fmt.layout, [self._backend.register(a, n) for a, n in fmt.layout.regions()])
        return got[1]

    def copy_hashing(self, c: NodeConn, local, offsets, lengths, counts, *, into: bool) -> list:
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

    def staged_descs(self, c: NodeConn, slot_offsets, size: int):
        """int64 ``[n, 5]`` descriptors moving whole objects of ``size`` bytes between
        staging (object ``i`` at ``i * size``) and the slots at ``slot_offsets`` of ``c``."""
        import numpy as np

        n = len(slot_offsets)
        return np.stack([np.full(n, self.stage_region, np.int64), np.arange(n, dtype=np.int64) * size,
                         np.full(n, c.region, np.int64), np.asarray(slot_offsets, np.int64),
                         np.full(n, size, np.int64)], axis=1)

    def read_hits(self, c: NodeConn, fmt, hits, ids, bad: list) -> list:
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
                      [fmt.checks(h[3], base=self.stage_ptr + n * size) for n, h in enumerate(hits)])
            if c.slots_local != 0 and all(len(ch) == 1 for ch in checks if ch):
                crcs = [ch[0][2] if ch else None for ch in checks]
        if crcs is not None:  # same host, slots mapped here: one pass copies each object and hashes what arrived
            warm_copy_pool(len(hits) * size)
            verdict = self._read_hashing(c, fmt, hits, ids, crcs)
        else:  # one-sided reads, descriptors per run (straight into the blocks) or per object
            offs = [off for _, off, *_ in hits]
            if fmt.zero_copy:
                descs, ends = descs_into_slots(fmt, self.pool_regions(fmt), [ids[h[0]] for h in hits], offs,
                                                c.region)
            else:
                descs, ends = self.staged_descs(c, offs, size), np.arange(1, len(hits) + 1)
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
                    pending = (first, self.hasher.submit(_verify, checks[first:first + step]))
            if pending is not None:
                self._collect(pending, verdict)
        good = []
        for n, ((i, *_, pin), fine) in enumerate(zip(hits, verdict)):
            if fine:
                good.append((n, i))
            else:
                bad.append(pin)
        if not fmt.zero_copy:
            self.unpack_runs(fmt, good, ids)
        return [i for _, i in good]

    def _read_hashing(self, c: NodeConn, fmt, hits, ids, crcs) -> list:
        """The reads of :meth:`read_hits` for whole-object checksums ``crcs`` (one per hit,
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
            copy = runs_into_slots(fmt, [ids[hits[n][0]] for n in wanted], offs)
        else:  # whole, into staging
            size = fmt.nbytes
            copy = (self.stage_ptr + np.asarray(wanted, np.int64) * size, np.asarray(offs, np.int64),
                    np.full(len(wanted), size, np.int64), [1] * len(wanted))
        for n, got in zip(wanted, self.copy_hashing(c, *copy, into=True)):
            verdict[n] = crcs[n] == NO_CRC or got == crcs[n]
        return verdict

    @staticmethod
    def _collect(pending, verdict) -> None:
        first, fut = pending
        for k, fine in enumerate(fut.result()):
            verdict[first + k] = fine

    def unpack_runs(self, fmt, ok, ids) -> None:
        """Unpack the verified objects ``ok`` (``[(staging slot n, key position i)]``):
        consecutive staging slots in one call."""
        size = fmt.nbytes
        s = 0
        while s < len(ok):
            e = s + 1
            while e < len(ok) and ok[e][0] == ok[e - 1][0] + 1:
                e += 1
            n0 = ok[s][0]
            fmt.unpack_many(self.staging[n0 * size:], [ids[i] for _, i in ok[s:e]])
            s = e


def _checksums(sums) -> list:
    """:func:`checksum` of each ``(addrs, lengths)`` (the hasher thread runs this)."""
    return [checksum(a, n) for a, n in sums]


def _verify(checks) -> list:
    """Per object, whether every ``(addrs, lengths, crc)`` of its :meth:`ObjectFormat.checks`
    holds (None: a malformed checksum, bad; an object put without one, ``NO_CRC``, never
    reaches here: :meth:`KVStore._screen <kvxfer.store.client.KVStore>` refused it)."""
    return [c is not None and all(checksum(a, n) == crc for a, n, crc in c) for c in checks]


def descs_into_slots(fmt, regions, block_ids, slot_offsets, region: int):
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


def runs_into_slots(fmt, block_ids, slot_offsets):
    """``(local, offsets, lengths, counts)`` for :meth:`Copier.copy_hashing` of whole
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


def warm_copy_pool(nbytes: int) -> None:
    """A copy of ``nbytes`` is about to run through :meth:`Copier.copy_hashing`: where it is
    large enough to go to the same-host copy pool, wake its helpers now, so that they
    start with the calling thread rather than tens of microseconds later."""
    c = load()
    if nbytes >= c.VM_SPLIT_BYTES:
        c.warm_copy_pool(_WARM_US)
