"""Where workers find each other and the router finds workers.

A :class:`Member` (name, role, control address, agent address, model, load...)
is published under a prefix with a time-to-live and kept alive by its owner;
readers list or watch the prefix. Two implementations:

- :class:`StaticDiscovery` (``static://HOST:PORT,HOST:PORT``): addresses given
  directly, nothing published (the router learns each worker's role from it).
- :class:`EtcdDiscovery` (``etcd://HOST:PORT[/prefix]``): etcd v3 through its
  HTTP gateway (``etcd3gw``); a member lives under a lease of ``ttl`` seconds
  refreshed every ``ttl/3``, so a dead publisher disappears within ``ttl``.

Never stored: the shared secret (it stays in each process's environment).
"""
from .base import Discovery, Member, Registration, open_discovery
from .static import StaticDiscovery

__all__ = ["Discovery", "Member", "Registration", "StaticDiscovery", "open_discovery"]
