"""``KeyTable``: a store node's committed keys, published for same-host lookups.

A node keeps its index (:class:`~kvxfer.store.index.SlotIndex`) in its own process;
the key table mirrors the index's committed keys into a small
:func:`kvxfer.shared_empty` region that the node registers beside its slots and names
in its INFO (only authenticated clients learn of it). A client on the same host
(the backend's ``"vm"`` path, which maps the node's shared regions) answers
``lookup`` for that node by reading the table: no request, no wake-up of the node.
Clients on other hosts send the keys to the node's backend, which answers from the same
table inside its progress (one UCX message each way, no Python on the node:
csrc/remote_lookup.cpp); any key the table cannot answer is asked of the node on its socket.

The table is a hash set of key fingerprints (XXH3-64) in ``nbuckets`` buckets of 7,
one cache line each (``nbuckets`` the power of two >= the node's slots: 64-128 bytes a
slot, a bucket holding at most one key on average), every field one machine word read
and written atomically, so readers need no lock (csrc/key_table.h). The node's I/O
thread is its only writer. A key whose bucket is full is not written but counted
there, and a read that misses in such a bucket answers *unknown*. A heartbeat the
node refreshes every tick (0.2 s) and clears when it closes tells readers whether the
table is current: a table older than :data:`STALE_S` (a node killed, stopped or hung)
is not read.

A lookup is advice either way: a key the table shows can be evicted before the get
(or, at odds of 2^-64, share its fingerprint with one that is present), and the get
then misses at the node and the engine recomputes. Readers take the geometry
from the node's INFO, so a table overwritten by anyone able to write the region gives
wrong answers, never a read outside it.
"""
from __future__ import annotations

__all__ = ["KeyTable", "STALE_S", "PRESENT", "ABSENT", "UNKNOWN"]

STALE_S = 1.0  # a table whose heartbeat is older is not read
PRESENT, ABSENT, UNKNOWN = 1, 0, 2  # what find() says per key


class KeyTable:
    """The table of ``nbuckets`` buckets at address ``base`` (mapped by the caller; see the module doc)."""

    __slots__ = ("base", "nbuckets", "_c", "num_overflows")

    def __init__(self, base: int, nbuckets: int) -> None:
        from .._native import load

        if isinstance(nbuckets, bool) or not isinstance(nbuckets, int) or nbuckets < 1 or nbuckets & (nbuckets - 1):
            raise ValueError(f"nbuckets must be a power of two >= 1, got {nbuckets!r}")
        if not isinstance(base, int) or base <= 0:
            raise ValueError("base must be a mapped address")
        self.base, self.nbuckets = base, nbuckets
        self._c = load()
        self.num_overflows = 0  # adds that found their bucket full (writer side)

    @staticmethod
    def buckets_for(num_slots: int) -> int:
        """The buckets a node of ``num_slots`` slots publishes (>= its slots: a full node's
        bucket holds at most one key on average, and 7 fit)."""
        n = 1
        while n < num_slots:
            n *= 2
        return n

    @staticmethod
    def nbytes(nbuckets: int) -> int:
        """Bytes of a table of ``nbuckets`` buckets, header included."""
        from .._native import load

        return int(load().key_table_bytes(nbuckets))

    # ---- the node (the one writer) ----------------------------------------------------
    def init(self) -> None:
        """Empty the table and start its heartbeat."""
        self._c.key_table_init(self.base, self.nbuckets)

    def add(self, key: bytes) -> None:
        if not self._c.key_table_add(self.base, self.nbuckets, key):
            self.num_overflows += 1

    def remove(self, key: bytes) -> None:
        self._c.key_table_remove(self.base, self.nbuckets, key)

    def beat(self, alive: bool = True) -> None:
        """Refresh the heartbeat; ``alive=False``: readers stop reading at once."""
        self._c.key_table_beat(self.base, alive)

    # ---- readers ------------------------------------------------------------------------
    def is_fresh(self) -> bool:
        """The writer beat within :data:`STALE_S` (and the header matches the geometry)."""
        age = self._c.key_table_age_ns(self.base, self.nbuckets)
        return 0 <= age <= STALE_S * 1e9

    def find(self, keys: list) -> bytes:
        """Per key (bytes, 1..64) one byte: :data:`PRESENT`, :data:`ABSENT` or :data:`UNKNOWN`."""
        return self._c.key_table_find(self.base, self.nbuckets, keys)
