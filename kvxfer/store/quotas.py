"""``Quotas``: what one client, and every client together, may hold on a store node.

A node's capacity is its clients' shared cache, so what a client holds outside the cache
is bounded as a fraction of the node, not per connection:

- **reservations** (keys reserved and being written, and spare slots): one client at most
  ``client_reserved`` of the node's bytes (in chunk bytes), all clients together at most
  ``total_reserved``; a reservation past either answers ``LIMIT`` for that key (its put
  skips or retries it) and evicts nothing. Committed objects are the cache: they count
  against no client.
- **spare slots** (same-host clients' slots held for their next put): one client at most
  ``client_spares``, all together at most ``total_spares`` (inside the reservation
  bounds); a spare is taken only from free chunks (it never costs an object) and lapses
  ``spare_lease_s`` after it was handed out unless used, so idle clients give them back.
- **reply bytes** queued for a client that does not read them: one client at most
  ``client_replies`` (the node stops reading its requests past that), all clients together
  about ``total_replies`` (past that only clients with nothing queued are served, one
  reply at a time, until the others drain: at most one more reply per client).

A client is its identity: the source address of its connection and the client id it
sent in its handshake (a :class:`~kvxfer.KVStore` keeps one for its lifetime, over
reconnects). Clients hold the deployment's secret, so an id is a claim: a client that
claims many ids is still bounded by the totals. Every bound holds at least one object of
the node's largest size, so a small node still serves one put at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Quotas", "Holdings"]


@dataclass(frozen=True)
class Quotas:
    """Bounds of what clients hold on a node (see the module doc); fractions of its capacity."""

    client_reserved: float = 0.25
    total_reserved: float = 0.75
    client_spares: float = 1 / 16
    total_spares: float = 0.25
    spare_lease_s: float = 10.0
    client_replies: int = 8 << 20
    total_replies: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("client_reserved", "total_reserved", "client_spares", "total_spares"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ValueError(f"Quotas.{name} must be a fraction in (0, 1], got {v!r}")
        if self.client_reserved > self.total_reserved or self.client_spares > self.total_spares:
            raise ValueError("a client's quota cannot exceed the total")
        if isinstance(self.spare_lease_s, bool) or not isinstance(self.spare_lease_s, (int, float)) \
                or not self.spare_lease_s > 0:
            raise ValueError(f"Quotas.spare_lease_s must be > 0, got {self.spare_lease_s!r}")
        for name in ("client_replies", "total_replies"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 4096:
                raise ValueError(f"Quotas.{name} must be an int >= 4096 bytes, got {v!r}")
        if self.client_replies > self.total_replies:
            raise ValueError("a client's reply quota cannot exceed the total")

    def caps(self, region_bytes: int, largest_chunk: int) -> dict:
        """The byte bounds for a node of ``region_bytes`` whose largest chunk is
        ``largest_chunk``: ``{"client_reserved": B, "total_reserved": B, "client_spares": B,
        "total_spares": B}``, each at least one largest chunk."""
        return {name: max(largest_chunk, int(getattr(self, name) * region_bytes))
                for name in ("client_reserved", "total_reserved", "client_spares", "total_spares")}


class Holdings:
    """What each client identity holds on one node (chunk bytes of reservations and spares),
    and all of them together, against ``caps`` (:meth:`Quotas.caps`; None: unbounded, nothing
    counted). Connections (``owner`` ints) count against the identity :meth:`identify` gave
    them, else their own; owner 0 (the node itself) counts against nothing. Not thread-safe
    (the node's I/O thread)."""

    def __init__(self, caps: dict | None) -> None:
        self.caps = caps
        self._identity: dict[int, object] = {}  # owner -> client identity
        self._held: dict = {}  # identity -> chunk bytes of its reservations and spares
        self._spared: dict = {}  # identity -> chunk bytes of its spares
        self.held_total = self.spared_total = 0
        self.num_limited = 0  # reservations and spares refused for a quota

    def identify(self, owner: int, identity) -> None:
        self._identity[owner] = identity

    def identity_of(self, owner: int):
        return self._identity.get(owner)

    def forget(self, owner: int) -> None:
        self._identity.pop(owner, None)

    def may_hold(self, owner: int, chunk: int, *, spare: bool = False) -> bool:
        """One more reservation (``spare``: spare) of ``chunk`` bytes for ``owner`` keeps its
        client and every client within their caps (counted in ``num_limited`` when not)."""
        caps = self.caps
        if caps is None or owner == 0:
            return True
        who = self._identity.get(owner, owner)
        ok = (self._held.get(who, 0) + chunk <= caps["client_reserved"]
              and self.held_total + chunk <= caps["total_reserved"]
              and (not spare or (self._spared.get(who, 0) + chunk <= caps["client_spares"]
                                 and self.spared_total + chunk <= caps["total_spares"])))
        self.num_limited += not ok
        return ok

    def charge(self, owner: int, chunk: int, *, spare: bool = False):
        """Count ``chunk`` bytes against ``owner``'s client; returns what :meth:`uncharge`
        takes back (None: nothing was counted)."""
        if self.caps is None or owner == 0:
            return None
        who = self._identity.get(owner, owner)
        self._held[who] = self._held.get(who, 0) + chunk
        self.held_total += chunk
        if spare:
            self._spared[who] = self._spared.get(who, 0) + chunk
            self.spared_total += chunk
        return who, chunk, spare

    def uncharge(self, charge) -> None:
        if charge is None:
            return
        who, chunk, spare = charge
        _take(self._held, who, chunk)
        self.held_total -= chunk
        if spare:
            _take(self._spared, who, chunk)
            self.spared_total -= chunk


def _take(book: dict, who, chunk: int) -> None:
    left = book[who] - chunk
    if left:
        book[who] = left
    else:
        del book[who]
