"""etcd v3 discovery through the HTTP gateway (``etcd3gw``, pure Python).

Layout: ``{prefix}/members/{name}`` -> :meth:`Member.to_json`, attached to a
lease of ``ttl`` seconds (an integer, at least 2). A keep-alive thread refreshes
the lease every ``ttl/3``; if the lease was lost (etcd restarted, a long pause)
it makes a new one and publishes again. :meth:`Registration.close` revokes the
lease, which deletes the key at once; a publisher that dies without closing
disappears when its lease expires (at most ``ttl`` later).
"""
from __future__ import annotations

import logging
import math
import threading

from .base import DEFAULT_TTL_S, Discovery, Member, Registration

log = logging.getLogger("kvxfer.discovery")

DEFAULT_PREFIX = "/kvxfer"


def _client(host: str, port: int, timeout_s: float):
    try:
        import etcd3gw
    except ImportError:
        raise ImportError("etcd discovery needs the etcd3gw package: pip install 'kvxfer[discovery]'") from None
    return etcd3gw.client(host=host, port=port, timeout=timeout_s)


class _EtcdRegistration(Registration):
    def __init__(self, disc: "EtcdDiscovery", member: Member, ttl_s: float):
        self._disc = disc
        self._member = member
        self._ttl = max(2, int(math.ceil(ttl_s)))
        self._lock = threading.Lock()
        self._lease = None
        self._stop = threading.Event()
        self._put()  # the first publication fails loudly (bad address, etcd down)
        self._thread = threading.Thread(target=self._keep_alive, name="kvxfer-discovery-lease",
                                        daemon=True)
        self._thread.start()

    def _put(self) -> None:
        with self._lock:
            if self._lease is None:
                self._lease = self._disc.client.lease(self._ttl)
            self._disc.client.put(self._disc.key(self._member.name), self._member.to_json(),
                                  lease=self._lease)

    def update(self, member: Member) -> None:
        """Publish a new record (e.g. its load) under the same lease."""
        if member.name != self._member.name:
            raise ValueError("a registration keeps its member's name")
        self._member = member
        self._put()

    def _keep_alive(self) -> None:
        interval = self._ttl / 3.0
        while not self._stop.wait(interval):
            try:
                with self._lock:
                    lease = self._lease
                ttl = lease.refresh() if lease is not None else -1
                if ttl is None or int(ttl) <= 0:  # expired meanwhile: start over
                    log.warning("discovery lease of %s was lost; publishing again", self._member.name)
                    with self._lock:
                        self._lease = None
                    self._put()
            except Exception as exc:  # etcd unreachable: keep trying every interval
                log.warning("discovery keep-alive of %s failed: %s: %s", self._member.name,
                            type(exc).__name__, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.revoke()
            except Exception as exc:  # the key still goes when the lease expires
                log.warning("revoking the discovery lease of %s failed: %s", self._member.name, exc)


class EtcdDiscovery(Discovery):
    """``EtcdDiscovery(host, port, prefix="/kvxfer")``; see the module docstring."""

    def __init__(self, host: str, port: int, prefix: str = DEFAULT_PREFIX, *, timeout_s: float = 3.0):
        self.host, self.port = host, int(port)
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX
        self.client = _client(host, self.port, timeout_s)

    @classmethod
    def from_url(cls, rest: str, *, timeout_s: float = 3.0) -> "EtcdDiscovery":
        hostport, _, prefix = rest.partition("/")
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"etcd discovery URL must be etcd://HOST:PORT[/prefix], got etcd://{rest}")
        return cls(host.strip("[]"), int(port), prefix or DEFAULT_PREFIX, timeout_s=timeout_s)

    def key(self, name: str) -> str:
        return f"{self.prefix}/members/{name}"

    def publish(self, member: Member, ttl_s: float = DEFAULT_TTL_S) -> Registration:
        return _EtcdRegistration(self, member, ttl_s)

    def members(self) -> list[Member]:
        out = []
        for value, meta in self.client.get_prefix(f"{self.prefix}/members/"):
            try:
                out.append(Member.from_json(value))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring a malformed discovery record %r: %s", meta.get("key"), exc)
        return out
