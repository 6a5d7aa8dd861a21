"""Discovery without a service: the members' control addresses are given directly."""
from __future__ import annotations

from .base import Discovery, Member, Registration


class _NoRegistration(Registration):
    def update(self, member: Member) -> None:
        pass

    def close(self) -> None:
        pass


class StaticDiscovery(Discovery):
    """A fixed list; ``publish`` does nothing (whoever reads must be told the address).

    Members built from bare addresses have an empty role: the router learns it
    from the worker's ``ready`` message when it connects."""

    def __init__(self, members: list[Member]):
        self._members = list(members)

    @classmethod
    def from_url(cls, rest: str) -> "StaticDiscovery":
        addresses = [a.strip() for a in rest.split(",") if a.strip()]
        if not addresses:
            raise ValueError("static:// needs at least one HOST:PORT")
        return cls([Member(name=f"worker@{a}", role="", address=a) for a in addresses])

    def publish(self, member: Member, ttl_s: float = 0.0) -> Registration:
        return _NoRegistration()

    def members(self) -> list[Member]:
        return list(self._members)
