"""Store nodes in discovery: published under ``{prefix}/store`` with role ``"store"``.

A node of ``etcd://HOST:PORT/prefix`` lives at ``/prefix/store/members/{name}`` (not
beside the serving workers under ``/prefix/members/``, so routers never see it); its
member record's ``address`` is the node's ``HOST:PORT`` (also its name in placement).
``static://HOST:PORT,...`` lists nodes directly.
"""
from __future__ import annotations

__all__ = ["open_store_discovery", "store_addresses", "check_address", "SUBPREFIX"]

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
