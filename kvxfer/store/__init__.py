"""The KV store: a pool of KV blocks shared across requests, engines and hosts.

- :mod:`.keys`: ``block_keys`` (chained content keys of a prompt's full blocks) and
  ``extend_keys`` (the same chain continued as a sequence grows);
- :mod:`.objects`: what an object holds (one block, every layer and head, wire format);
- :mod:`.index`: a node's slots, key -> object, LRU eviction, pins;
- :mod:`.protocol`: the store's wire vocabulary (requests, reply codes, what each side
  names itself in the handshake);
- :mod:`.quotas`: what one client and all clients may hold on a node;
- :mod:`.node`: ``StoreNode``, one node (``kvxfer store``), dispatching each request to
  its handler in :mod:`.requests`;
- :mod:`.placement`: rendezvous hashing of keys over live nodes;
- :mod:`.client`: ``KVStore``, an engine's client, over :mod:`.members` (which nodes,
  which are up, where a key lives), :mod:`.conn` (one node's connection),
  :mod:`.lookup`, :mod:`.copies` (how bytes move, for puts and gets) and :mod:`.spares`.

See docs/store.md. Importing this package loads neither torch nor UCX.
"""
from __future__ import annotations

from .keys import block_keys, extend_keys

__all__ = ["KVStore", "StoreNode", "block_keys", "extend_keys"]


def __getattr__(name: str):
    if name == "KVStore":
        from .client import KVStore

        return KVStore
    if name == "StoreNode":
        from .node import StoreNode

        return StoreNode
    raise AttributeError(f"module 'kvxfer.store' has no attribute {name!r}")
