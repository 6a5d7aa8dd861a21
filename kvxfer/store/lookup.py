"""A client's ``lookup``: how many leading keys of a chain the pool holds now.

Three routes, all in flight at once: a node on this host is answered from its key table
in shared memory (:mod:`kvxfer.store.key_table`, no request); a node on another host gets
one message through the backend, which the node's backend answers from the same table in
its progress (csrc/remote_lookup.cpp); a node that cannot tell, or answers no such
message, gets a LOOKUP request on its socket. A lookup never claims what it cannot know:
a key whose node is down is absent.
"""
from __future__ import annotations

import bisect
from operator import itemgetter

from ..errors import InvalidDescriptor, KVXferError
from ..transport.base import LOOKUP_MAX_KEYS
from .conn import NodeConn
from .key_table import ABSENT, UNKNOWN
from .keys import check_keys
from .protocol import MAX_KEYS, Req

__all__ = ["Lookup"]


class Lookup:
    """``Lookup(members, counters, timeout)(keys) -> int`` over a client's
    :class:`~kvxfer.store.members.Members` (``counters``: the client's, the lookup routes
    are counted there)."""

    def __init__(self, members, counters: dict, timeout: float) -> None:
        self._members, self.counters, self.timeout = members, counters, timeout

    def __call__(self, keys) -> int:
        """How many leading ``keys`` are in the pool now: :meth:`kvxfer.KVStore.lookup`,
        whose docstring says which route each node's keys take."""
        keys = check_keys(keys)
        if not keys:
            return 0
        routes = self._members.route(keys)
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
                    self._members.mark_down(addr, exc)
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
                    self._members.mark_down(addr, exc)
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
            return self._members.conn(addr), pos, first_absent
        except KVXferError as exc:
            self._members.mark_down(addr, exc)
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
                    self._members.mark_down(addr, exc)
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
                self._members.mark_down(addr, exc)
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
        c = self._members.conns.get(address)  # (one dict read: atomic)
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
