"""Which parts of one recv have landed: cells of (layer, kv head, block).

A piece (one DATA_DONE) covers some layers, a head range and either every block
of the request (zero-copy) or a slice of them (a pack chunk of a request larger
than half the staging ring). A layer is done once every (head, block) cell of
it landed; the recv is done once every requested layer is. The common pieces
-- a whole layer or the whole request -- are counted without any array; only a
partial piece allocates a ``bool [blocks, heads]`` grid for its layers.
"""
from __future__ import annotations

import numpy as np


class Coverage:
    """Landed cells of one recv: ``layers`` (tuple), ``num_heads`` local heads, ``blocks`` (distinct ids)."""

    def __init__(self, layers: tuple, num_heads: int, blocks: tuple) -> None:
        self.layers = frozenset(layers)
        self.num_heads = num_heads
        self.blocks = blocks
        self.done: set = set()  # layers whose every cell landed
        self._cells: dict = {}  # layer -> bool ndarray [len(blocks), num_heads] (partial layers only)
        self._index: dict | None = None  # block id -> position, built on the first partial piece

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.layers)

    def positions(self, blocks) -> np.ndarray | None:
        """Positions of ``blocks`` in the request (int64 ``[n]``); None if one is not part of it
        or appears twice."""
        if self._index is None:
            self._index = {b: i for i, b in enumerate(self.blocks)}
        index = self._index
        pos = [index.get(b, -1) for b in blocks]
        if not pos or min(pos) < 0 or len(set(pos)) != len(pos):
            return None
        return np.asarray(pos, dtype=np.int64)

    def add(self, layers, lo: int, hi: int, pos: np.ndarray | None) -> list:
        """Mark local heads ``[lo, hi)`` of blocks ``pos`` (None: every block) in ``layers``;
        return the layers that became complete."""
        landed = []
        whole = pos is None or len(pos) == len(self.blocks)
        for layer in layers:
            if layer in self.done or layer not in self.layers:
                continue
            cells = self._cells.get(layer)
            if cells is None and whole and lo == 0 and hi == self.num_heads:
                self.done.add(layer)
                landed.append(layer)
                continue
            if cells is None:
                cells = self._cells[layer] = np.zeros((len(self.blocks), self.num_heads), dtype=bool)
            if pos is None:
                cells[:, lo:hi] = True
            else:
                cells[pos, lo:hi] = True
            if cells.all():
                del self._cells[layer]
                self.done.add(layer)
                landed.append(layer)
        return landed

    def heads_landed(self, lo: int, hi: int) -> bool:
        """True if local heads ``[lo, hi)`` of every block of every layer landed."""
        if hi <= lo:
            return True
        for layer in self.layers:
            if layer in self.done:
                continue
            cells = self._cells.get(layer)
            if cells is None or not cells[:, lo:hi].all():
                return False
        return True
