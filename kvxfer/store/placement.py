"""Where a key lives: rendezvous (highest-random-weight) hashing over live nodes.

Every client ranks the nodes for a key by ``blake2b(node name | key)`` and puts the
object on the first ``replicas`` of that ranking; no master is asked. A node that
leaves moves only its own keys (each to its next-ranked node); a node that joins
takes about ``1/num_nodes`` of every node's keys. Each key of a prefix chain is
placed on its own, so a chain of ``n`` blocks spreads over the nodes evenly and a
lookup of it costs one round trip to each node it touches, in parallel.
"""
from __future__ import annotations

import hashlib

__all__ = ["rank_nodes", "owners", "Placement"]


def _score(node: str, key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=8, key=node.encode()[:64]).digest()


def rank_nodes(nodes, key: bytes) -> list[str]:
    """``nodes`` (names) ordered best-first for ``key``; deterministic in every process."""
    return sorted(nodes, key=lambda n: _score(n, key), reverse=True)


def owners(nodes, key: bytes, replicas: int = 1) -> list[str]:
    """The ``replicas`` best nodes for ``key`` (fewer if there are fewer nodes)."""
    if replicas == 1:  # the hot path: one pass, no sort
        best, best_score = None, b""
        for n in nodes:
            s = _score(n, key)
            if best is None or s > best_score:
                best, best_score = n, s
        return [] if best is None else [best]
    return rank_nodes(nodes, key)[:replicas]


class Placement:
    """``owners`` over one fixed set of ``nodes``, memoized: an engine looks a chain up,
    then gets or puts the same keys, so each key is ranked once per membership. At most
    ``max_cached`` keys are kept (the memo starts over when full)."""

    def __init__(self, nodes, replicas: int = 1, max_cached: int = 1 << 20) -> None:
        self.nodes = tuple(sorted(nodes))
        self.replicas = replicas
        self._max = max_cached
        self._memo: dict[bytes, list] = {}
        self._first: dict[bytes, str] = {}  # key -> its first owner ("" if none), for route()

    def route(self, keys: list) -> dict:
        """``{node: [positions]}``: each key's first owner, positions in order (keys of no
        node when there are none)."""
        if len(self.nodes) == 1:  # one node owns every key
            return {self.nodes[0]: list(range(len(keys)))}
        firsts = list(map(self._first.get, keys))
        for i in [i for i, f in enumerate(firsts) if f is None]:
            own = self.owners(keys[i])
            firsts[i] = self._first[keys[i]] = own[0] if own else ""
        out: dict = {}
        for i, node in enumerate(firsts):
            pos = out.get(node)
            if pos is None:
                out[node] = [i]
            else:
                pos.append(i)
        out.pop("", None)
        return out

    def owners(self, key: bytes) -> list[str]:
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= self._max:
                self._memo.clear()
                self._first.clear()
            got = self._memo[key] = owners(self.nodes, key, self.replicas)
        return got
