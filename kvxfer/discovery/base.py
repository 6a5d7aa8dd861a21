"""The discovery interface: publish a :class:`Member` with a TTL, list and watch the rest."""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

log = logging.getLogger("kvxfer.discovery")

ROLES = ("prefill", "decode", "colocated", "store")
DEFAULT_TTL_S = 5.0
DEFAULT_POLL_S = 0.5


@dataclass(frozen=True)
class Member:
    """One published worker. ``address``: its control address (``host:port``), the
    key readers connect to; ``agent_address``: its kvxfer agent; ``model``: the
    model's name (a router only pairs workers of its own model); ``info``: the
    rest (``num_blocks``, ``block_size``, ``load`` ...), JSON values only."""

    name: str
    role: str
    address: str
    agent_address: str | None = None
    model: str | None = None
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"member name must be non-empty without '/', got {self.name!r}")
        if self.role not in ROLES + ("",):
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Member":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("member record is not a JSON object")
        return cls(name=str(data["name"]), role=str(data.get("role", "")),
                   address=str(data["address"]), agent_address=data.get("agent_address"),
                   model=data.get("model"), info=dict(data.get("info") or {}))


class Registration:
    """A published member kept alive until :meth:`close` (which withdraws it)."""

    def update(self, member: Member) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Watch:
    """Calls ``on_change(members_by_name)`` from a thread whenever the set changes
    (and once at the start); :meth:`stop` ends it (bounded join)."""

    def __init__(self, discovery: "Discovery", on_change: Callable[[dict[str, Member]], None],
                 interval_s: float = DEFAULT_POLL_S):
        self._discovery, self._on_change, self._interval = discovery, on_change, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-discovery-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: dict[str, Member] | None = None
        failures = 0
        while not self._stop.is_set():
            try:
                now = {m.name: m for m in self._discovery.members()}
                failures = 0
            except Exception as exc:  # discovery unreachable: keep the last view, retry
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("discovery unreachable (%s: %s); retrying", type(exc).__name__, exc)
                self._stop.wait(min(self._interval * 2 ** min(failures, 4), 5.0))
                continue
            if now != last:
                last = now
                try:
                    self._on_change(dict(now))
                except Exception:
                    log.exception("discovery watch callback failed")
            self._stop.wait(self._interval)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


class Discovery:
    """Publish members and list/watch them. Implementations: static, etcd."""

    def publish(self, member: Member, ttl_s: float = DEFAULT_TTL_S) -> Registration:
        raise NotImplementedError

    def members(self) -> list[Member]:
        """The members published now (bounded by the backend's request timeout)."""
        raise NotImplementedError

    def watch(self, on_change: Callable[[dict[str, Member]], None],
              interval_s: float = DEFAULT_POLL_S) -> Watch:
        """Call ``on_change`` with the current members whenever they change.

        The view is re-read every ``interval_s`` (a poll has a timeout, so a broken
        connection can only delay updates, never stall the watcher)."""
        return Watch(self, on_change, interval_s)

    def close(self) -> None:
        pass


def open_discovery(url: str, *, timeout_s: float = 3.0) -> Discovery:
    """``etcd://HOST:PORT[/prefix]`` or ``static://HOST:PORT[,HOST:PORT...]``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"discovery URL needs a scheme (etcd:// or static://), got {url!r}")
    if scheme == "static":
        from .static import StaticDiscovery

        return StaticDiscovery.from_url(rest)
    if scheme == "etcd":
        from .etcd import EtcdDiscovery

        return EtcdDiscovery.from_url(rest, timeout_s=timeout_s)
    raise ValueError(f"unknown discovery scheme {scheme!r} (etcd, static)")
