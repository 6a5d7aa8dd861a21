"""What a store node's index (:class:`~kvxfer.store.index.SlotIndex`) records: each
object (:class:`Obj`), each TP rank's part of one (:class:`Part`), each reader's pin
(:class:`Pin`). Plain records; the index owns every change to them."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Obj", "Part", "Pin", "evictable"]


@dataclass(eq=False)
class Part:
    """One TP rank's heads ``[lo, hi)`` of a multi-part object."""
    lo: int
    hi: int
    owner: int
    token: int
    crc: int = 0
    committed: bool = False


@dataclass(eq=False)
class Obj:
    """One object of a node's index: pending (reserved, being written), committed, or a spare
    (no key); whole or assembled from :class:`Part` s."""
    key: bytes
    offset: int  # of its chunk in the buffer
    nbytes: int
    fmt: str
    owner: int  # the client that reserved it (a multi-part object: its first part's)
    token: int  # names this reservation (commits must quote it; 0 for a multi-part object)
    deadline: float  # pending: when the reservation lapses
    crc: int | list = 0  # whole: one checksum; multi-part: [[lo, hi, crc], ...] in head order
    pins: int = 0
    committed: bool = False
    dropped: bool = False  # left the index while pinned; slot freed at the last release
    num_heads: int = 0  # multi-part objects: the heads the parts must cover
    parts: list | None = None  # multi-part objects: their Parts, sorted by head (never overlapping)
    by_token: dict | None = None  # multi-part objects: token -> Part
    covered: int = 0  # multi-part objects: heads of the committed parts
    charge: tuple | None = None  # (client identity, chunk bytes, is a spare) while it counts against a quota


def evictable(obj: Obj) -> bool:
    """Committed, unpinned, still in the index."""
    return obj.committed and not obj.pins and not obj.dropped


@dataclass(eq=False)
class Pin:
    """A reader's pin of ``obj`` (until released or ``deadline``)."""
    obj: Obj
    owner: int
    deadline: float
