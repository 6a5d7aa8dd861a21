"""What a store operation's handle reports once it ended: ``handle.result``.

A :meth:`KVStore.put <kvxfer.KVStore.put>` handle's ``result`` is a :class:`PutResult`
(objects stored, keys present already, keys skipped, keys refused for overlapping parts);
a :meth:`~kvxfer.KVStore.get` handle's, a :class:`GetResult` (objects loaded, from the
disk tier among them, keys missed, checksum failures). Both are set before the handle
becomes final (done or failed), so a caller that waited reads them at once. They are
this call's share of the client's counters (``stats()["client"]``): a client runs one
operation at a time, so the counts it added meanwhile are the operation's.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PutResult", "GetResult", "OpReport"]


@dataclass(frozen=True)
class PutResult:
    stored: int  # objects this put committed
    present: int  # keys the pool held already (a no-op that refreshed them)
    skipped: int  # keys not put: their node down, full or at a limit, the key being written by another client
    conflicts: int  # keys refused for parts that overlap this rank's heads (StorePartConflict)


@dataclass(frozen=True)
class GetResult:
    loaded: int  # objects loaded into their blocks (in any order; the handle's error says the leading ones)
    from_disk: int  # of the objects the nodes answered, how many they read back from their disk tier
    misses: int  # keys not loaded: absent, their node down, or a checksum failure
    checksum_failures: int


class OpReport:
    """The completer a store operation runs with: :class:`~kvxfer.handle.HandleCompleter`'s
    ``succeed``, ``fail`` and ``add_bytes``, setting ``handle.result`` from the deltas of
    ``counters`` (the client's) since the operation began, before the handle becomes final."""

    def __init__(self, completer, counters: dict) -> None:
        self._completer, self._counters = completer, counters
        self._before = dict(counters)
        self.handle = completer.handle

    def add_bytes(self, nbytes: int) -> None:
        self._completer.add_bytes(nbytes)

    def succeed(self) -> bool:
        self._report()
        return self._completer.succeed()

    def fail(self, error) -> bool:
        self._report()
        return self._completer.fail(error)

    def _report(self) -> None:
        d = {k: v - self._before.get(k, 0) for k, v in self._counters.items()}
        if self.handle.kind == "store_put":
            self.handle.result = PutResult(d["put_objects"], d["put_present"], d["put_skipped"], d["put_conflicts"])
        else:
            self.handle.result = GetResult(d["get_objects"], d["get_disk_objects"], d["get_misses"],
                                           d["checksum_failures"])
