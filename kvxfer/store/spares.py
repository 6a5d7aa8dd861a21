"""Spare slots: chunks a node on this host holds for a client under no key, so that its
next put of whole objects writes into them and commits in one round trip (COMMIT_SPARE)
instead of two (RESERVE, COMMIT).

After each put the client tops its spares up to what that put wrote (at most
:data:`SPARES_HELD`, and 1/16 of the node's slots), off the put's critical path; a put
short of spares asks for free ones first (unless the node's last answer had none) and
reserves the keys it still has none for. A node hands out only free chunks as spares (a
spare never costs an object), bounded by its quotas (:mod:`kvxfer.store.quotas`); each is
used within half its lease. The spares live on the connection (``NodeConn.spares``), used
under its lock by the client's worker.
"""
from __future__ import annotations

import logging
import time

from ..errors import KVXferError
from . import protocol as wire
from .conn import NodeConn, NodeError
from .key_table import PRESENT
from .protocol import Req

__all__ = ["Spares", "SPARES_HELD"]

log = logging.getLogger("kvxfer.store")

# spare slots a connection to a node on this host keeps for the next put (asked for after a
# put, as many as it wrote, up to this, a 2,048-token prompt's blocks at 16 tokens a block,
# and to 1/16 of the node's slots, so that a small node is not held by spares)
SPARES_HELD = 128


class Spares:
    """A client's use of its connections' spare slots (``members``: its
    :class:`~kvxfer.store.members.Members`; ``counters``: its counters)."""

    def __init__(self, members, counters: dict, timeout: float) -> None:
        self._members, self.counters, self.timeout = members, counters, timeout

    def for_put(self, c: NodeConn, keys, size: int):
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
            self.ask(c, len(want) - len(c.spares), evict=False)
            if not c.spare_slots:
                return [], [], []
        take, c.spares = c.spares[:len(want)], c.spares[len(want):]
        got = [(j, off, tok, use_by) for j, (off, tok, use_by) in zip(want, take)]
        c.spares_wanted = min(SPARES_HELD, len(want), c.num_slots // 16)
        return got, present, want[len(got):]

    def ask(self, c: NodeConn, count: int, *, evict: bool) -> None:
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

    def commit(self, c: NodeConn, keys, got, present, crcs, size: int, fmt) -> None:
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

    def refill(self, conns) -> None:
        """After a put: top the spares of ``conns`` up to what each last put wrote, from the
        nodes' free slots (off the put's critical path: its handle is done). A node that
        fails here is marked down."""
        for c in conns:
            with c.lock:
                n = c.spares_wanted - len(c.spares)
                if n <= 0 or c.closed or not c.spare_slots:
                    continue
                try:
                    self.ask(c, n, evict=False)  # ahead of need: never at an object's cost
                except KVXferError as exc:  # gone, late, or an answer that makes no sense
                    self._members.mark_down(c.address, exc)
