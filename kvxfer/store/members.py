"""Store nodes: where clients find them, and a client's view of them (:class:`Members`).

Nodes in discovery are published under ``{prefix}/store`` with role ``"store"``.

A node of ``etcd://HOST:PORT/prefix`` lives at ``/prefix/store/members/{name}`` (not
beside the serving workers under ``/prefix/members/``, so routers never see it); its
member record's ``address`` is the node's ``HOST:PORT`` (also its name in placement).
``static://HOST:PORT,...`` lists nodes directly.
"""
from __future__ import annotations

import logging
import threading
import time

from ..errors import AuthenticationError
from .conn import NodeConn
from .placement import Placement

__all__ = ["open_store_discovery", "store_addresses", "check_address", "SUBPREFIX", "Members"]

log = logging.getLogger("kvxfer.store")

SUBPREFIX = "store"


def open_store_discovery(url: str, *, timeout_s: float = 3.0):
    """The :class:`~kvxfer.discovery.Discovery` store nodes publish to and clients read."""
    from ..discovery import open_discovery

    disc = open_discovery(url, timeout_s=timeout_s)
    if hasattr(disc, "prefix"):  # etcd
        disc.prefix = disc.prefix.rstrip("/") + "/" + SUBPREFIX
    return disc


def store_addresses(members: dict) -> list[str]:
    """Addresses of the store nodes among ``members`` (``{name: Member}``), sorted; a
    static list's bare addresses (role ``""``) count as nodes."""
    return sorted({m.address for m in members.values() if m.role in ("store", "")})


def check_address(a) -> str:
    """``a`` if it is a ``"HOST:PORT"`` string (a node given by address), else
    ``TypeError`` / ``ValueError``."""
    from ..net import split_address

    if not isinstance(a, str):
        raise TypeError(f"node addresses must be 'HOST:PORT' strings, got {type(a).__name__}")
    split_address(a)
    return a


class Members:
    """A client's view of the pool's nodes: their addresses, which are up, its connection
    to each (authenticated, :class:`~kvxfer.store.conn.NodeConn`), and where a key lives
    (rendezvous placement over the live ones, :mod:`kvxfer.store.placement`). A node that
    fails is down for ``retry_s`` (:meth:`mark_down`), then tried again. Thread-safe.

    ``counters``: the client's counters (``node_failures``, ``auth_failures`` are counted
    here); ``client_id``: the identity its connections name (the nodes' quotas count it).
    """

    def __init__(self, secret: bytes, backend, *, timeout: float, retry_s: float, counters: dict,
                 client_id: str) -> None:
        self._secret, self._backend = secret, backend
        self.timeout, self.retry_s = timeout, retry_s
        self.counters, self.client_id = counters, client_id
        self._lock = threading.Lock()
        self.addresses: list[str] = []
        self.conns: dict[str, NodeConn] = {}
        self._down: dict[str, float] = {}  # address -> monotonic time it may be tried again
        self._refused: set[str] = set()  # members whose last handshake refused our secret
        self._placements: dict[int, Placement] = {}

    def set(self, addresses) -> None:
        """The members are ``addresses`` now (a discovery update)."""
        with self._lock:
            self.addresses = list(addresses)

    def known(self) -> int:
        with self._lock:
            return len(self.addresses)

    def nodes(self) -> dict:
        """``{address: "up" | "down"}`` for every known node."""
        now = time.monotonic()
        with self._lock:
            return {a: ("down" if self._down.get(a, 0) > now else "up") for a in self.addresses}

    def live(self) -> list:
        now = time.monotonic()
        with self._lock:
            return [a for a in self.addresses if self._down.get(a, 0) <= now]

    def placement(self, replicas: int) -> Placement:
        """Placement over the live nodes now (memoized per membership and replica count)."""
        live = tuple(sorted(self.live()))
        cached = self._placements.get(replicas)
        if cached is None or cached.nodes != live:
            cached = self._placements[replicas] = Placement(live, replicas)
        return cached

    def conn(self, address: str) -> NodeConn:
        with self._lock:
            c = self.conns.get(address)
        if c is not None and not c.closed:
            return c
        c = NodeConn.open(address, self._secret, self._backend, self.timeout, client_id=self.client_id)
        with self._lock:
            old = self.conns.get(address)
            if old is not None and not old.closed:
                c.close()
                return old
            self.conns[address] = c
            self._down.pop(address, None)
            self._refused.discard(address)
        return c

    def mark_down(self, address: str, exc: BaseException) -> None:
        """Take ``address`` out of placement for ``retry_s``. A member that refuses this
        client's secret (a port squatter, a stale discovery record, a node left on an old
        secret) is down like a dead one, logged once with its address until it
        authenticates again; only when **every** member refuses it is the secret this
        client's misconfiguration, and the :class:`~kvxfer.AuthenticationError` is raised."""
        refused = isinstance(exc, AuthenticationError)
        with self._lock:
            self._down[address] = time.monotonic() + self.retry_s
            c = self.conns.pop(address, None)
            self.counters["node_failures"] += 1
            first = refused and address not in self._refused
            if refused:
                self._refused.add(address)
                self.counters["auth_failures"] += 1
            everyone = refused and bool(self.addresses) and self._refused.issuperset(self.addresses)
        if c is not None:
            c.close()
        if first:
            log.error("store node %s refused this client's secret (%s): down like a dead node, the pool serves "
                      "from the others (logged once, until it authenticates)", address, exc)
        elif not refused:
            log.warning("store node %s is down for %.1f s: %s", address, self.retry_s, exc)
        if everyone:
            raise exc

    def route(self, keys) -> dict:
        """``{address: [positions]}``: each key's first live owner."""
        return self.placement(1).route(keys)


    def close(self) -> None:
        """Disconnect every node."""
        with self._lock:
            conns, self.conns = list(self.conns.values()), {}
        for c in conns:
            c.close()
