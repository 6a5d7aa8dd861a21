"""What a pooled object holds, and the copies between an engine's blocks and objects.

An object is one block of every layer, **all** kv heads of the model, in the canonical
wire format (``docs/wire-format.md``)::

    object[num_layers, num_kv, 1, B, num_global_heads, D]    bytes of layout.dtype

which is exactly ``kvxfer.pack(layout, [block_id], heads=(0, num_global_heads))``. The
format depends on the model (fingerprint) and nothing else, so engines with other
layouts (NHD, HND, blocks-first, cross-layer) or TP degrees share objects:

* a rank that holds every head (``tp_size == 1``, or MLA) moves each object straight
  between its blocks and the slot, one descriptor per contiguous run (an NHD pool: one
  per layer and K/V), when the runs are long (:data:`ZERO_COPY_MIN_RUN`); else through
  staging, with one ``pack``/``unpack`` per block;
* a rank of a TP group holds ``head_range`` only. Its get reads whole objects and keeps
  its heads (the staging bytes are described as a ``"N L 2 B H D"`` pool and copied with
  ``pack(heads=...)`` -> ``unpack(heads=...)``). Its put writes its **part**: its heads
  of every (layer, K/V, token) row of the object, ``num_layers * num_kv * B`` strided
  runs of ``h * D * itemsize`` bytes (heads are the inner dim before D). They go
  straight from the blocks when the pool's runs span whole rows (NHD: each (layer,
  K/V) tile splits into its ``B`` rows), else from staging after a ``pack(heads=...)``
  (HND) - the same number of descriptors either way, one copy fewer straight. The
  node assembles the object from the group's parts (:mod:`kvxfer.store.index`).

Checksums: an object put whole carries XXH3-64 of its bytes; one put in parts carries
one checksum per part, XXH3-64 of that part's bytes in wire order (exactly
``pack(layout, [block], heads=(lo, hi))``), which its writer computes over its own
runs and a reader over the same heads of the object it read (:meth:`ObjectFormat.checks`).
"""
from __future__ import annotations

import hashlib

from .protocol import format_tag

__all__ = ["ObjectFormat", "checksum"]

# From this mean run length an object moves straight between the engine's blocks and the
# slot (one descriptor per run) rather than through staging (one more copy).
ZERO_COPY_MIN_RUN = 4096


def checksum(addrs, lengths) -> int:
    """XXH3-64 of the bytes of the runs ``[addrs[i], addrs[i] + lengths[i])`` taken in order
    (host memory; the same value however the bytes are split into runs). Never
    :data:`~kvxfer.store.protocol.NO_CRC`. Native, GIL released."""
    from .._native import load
    from .protocol import NO_CRC

    h = load().checksum_runs(addrs, lengths)
    return h - 1 if h == NO_CRC else h


class ObjectFormat:
    """The object geometry of ``layout`` (a :class:`~kvxfer.KVLayout`).

    ``nbytes``: bytes of one object; ``fmt``: a tag of the model fingerprint and of
    ``nbytes`` (:func:`~kvxfer.store.protocol.format_tag`; a node only returns an object
    to a get quoting the tag it was put with, and holds it only at that size); ``full``: this
    rank holds every kv head (it puts whole objects; else it puts its part: heads
    ``part`` of ``part_nbytes`` bytes, ``num_rows`` strided rows of ``part_row`` bytes).
    """

    def __init__(self, layout) -> None:
        from ..layout import KVLayout

        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a kvxfer.KVLayout, got {type(layout).__name__}")
        if layout.device.type != "cpu":
            raise ValueError("the store moves host pools only (a CUDA pool: stage it through host memory)")
        self.layout = layout
        self.heads = (0, layout.num_global_heads)
        self.part = tuple(layout.head_range)
        self.full = self.part == self.heads
        self.head_bytes = layout.head_dim * layout.itemsize  # one head of one token
        self.row_bytes = self.heads[1] * self.head_bytes  # one token of every head: a row of the object
        self.num_rows = layout.num_layers * layout.num_kv * layout.block_size
        self.nbytes = self.num_rows * self.row_bytes
        self.part_row = (self.part[1] - self.part[0]) * self.head_bytes
        self.part_nbytes = self.num_rows * self.part_row
        self.fmt = format_tag(hashlib.blake2b(layout.fingerprint().encode(), digest_size=16).hexdigest(), self.nbytes)
        self.bases = [a for a, _ in layout.regions()]
        self._runs: dict = {}
        self._arrays: dict = {}
        self._head_runs: dict = {}
        self._rows: dict = {}
        if self.full:  # gets and puts straight between blocks and slots when runs are long
            self.zero_copy = self.put_zero_copy = self.nbytes // len(self.runs(0)) >= ZERO_COPY_MIN_RUN
        else:  # gets through staging (whole objects); puts straight when no run splits a row
            self.zero_copy = False
            self.put_zero_copy = len(self.runs(0)) <= self.num_rows

    def runs(self, block_id: int):
        """int64 ``[num_runs, 4]`` of this rank's heads of block ``block_id``: pool region
        index, offset in it, offset in the object, length (see :meth:`KVLayout.block_runs`;
        a part's runs are split at rows, in wire order); computed once per block."""
        got = self._runs.get(block_id)
        if got is None:
            got = self.layout.block_runs([block_id], heads=self.part)
            if not self.full:
                got = self._to_object(got)
            self._runs[block_id] = got
        return got

    def addrs(self, block_id: int):
        """int64 ``[num_runs]``: the address of each run of :meth:`runs` ``(block_id)`` in
        the pool; computed once per block."""
        return self.run_arrays(block_id)[0]

    def run_arrays(self, block_id: int):
        """``(addrs, offsets, lengths)``, contiguous int64 ``[num_runs]`` each, of the runs of
        :meth:`runs` ``(block_id)``: address in the pool, offset in the object, length (what
        a same-host put or get copies, ready to concatenate over a call's blocks); computed
        once per block."""
        got = self._arrays.get(block_id)
        if got is None:
            import numpy as np

            runs = self.runs(block_id)
            got = self._arrays[block_id] = (np.ascontiguousarray(self.run_addrs(runs)),
                                            np.ascontiguousarray(runs[:, 2]), np.ascontiguousarray(runs[:, 3]))
        return got

    def _to_object(self, runs):
        """Runs of a part's wire bytes (column 2: offset in the part) split at its rows,
        column 2 mapped to the offset in the object."""
        import numpy as np

        pr = self.part_row
        first, last = runs[:, 2] // pr, (runs[:, 2] + runs[:, 3] - 1) // pr
        count = last - first + 1
        src = np.repeat(np.arange(len(runs)), count)
        row = np.repeat(first, count) + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count))
        start = np.maximum(row * pr, runs[src, 2])  # offset in the part
        end = np.minimum((row + 1) * pr, runs[src, 2] + runs[src, 3])
        return np.stack([runs[src, 0], runs[src, 1] + (start - runs[src, 2]),
                         row * self.row_bytes + self.part[0] * self.head_bytes + start - row * pr, end - start], axis=1)

    def rows(self, lo: int, hi: int):
        """int64 ``[num_rows]``: where heads ``[lo, hi)`` of each row start in an object
        (each ``(hi - lo) * head_bytes`` long; in wire order)."""
        got = self._rows.get((lo, hi))
        if got is None:
            import numpy as np

            got = self._rows[lo, hi] = np.arange(self.num_rows, dtype=np.int64) * self.row_bytes + lo * self.head_bytes
        return got

    def checks(self, crc, *, base: int | None = None, block_id: int | None = None):
        """What to hash to verify one object read: ``[(addrs, lengths, crc), ...]`` over
        the object at address ``base`` (staging), or over its bytes in block ``block_id``
        of the pool (a full, zero-copy layout). ``crc`` as a node sends it: an int (whole
        object) or ``[[lo, hi, crc], ...]`` (parts). None if ``crc`` is malformed (the
        parts do not cover every head once, in order): the object counts as bad."""
        import numpy as np

        def ok_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64

        if ok_int(crc):
            parts = [(0, self.heads[1], crc)]
        elif isinstance(crc, list) and crc:
            parts, at = [], 0
            for p in crc:
                if not (isinstance(p, list) and len(p) == 3 and all(ok_int(v) for v in p) and p[0] == at < p[1]):
                    return None
                parts.append(tuple(p))
                at = p[1]
            if at != self.heads[1]:
                return None
        else:
            return None
        out = []
        for lo, hi, c in parts:
            if base is not None:
                rows = self.rows(lo, hi)
                n = (hi - lo) * self.head_bytes
                if (lo, hi) == self.heads:
                    out.append(([base], [self.nbytes], c))
                else:
                    out.append((base + rows, np.full(len(rows), n, np.int64), c))
            elif (lo, hi) == self.heads:
                out.append((self.addrs(block_id), self.runs(block_id)[:, 3], c))
            else:
                runs = self._runs_of_heads(block_id, lo, hi)
                out.append((self.run_addrs(runs), runs[:, 3], c))
        return out

    def _runs_of_heads(self, block_id: int, lo: int, hi: int):
        got = self._head_runs.get((block_id, lo, hi))
        if got is None:
            if len(self._head_runs) >= 1 << 16:
                self._head_runs.clear()
            got = self._head_runs[block_id, lo, hi] = self.layout.block_runs([block_id], heads=(lo, hi))
        return got

    def run_addrs(self, runs):
        """int64 ``[num_runs]``: the address of each run of :meth:`runs` in the pool."""
        import numpy as np

        return np.asarray(self.bases, np.int64)[runs[:, 0]] + runs[:, 1]

    def checksum_runs(self, runs) -> int:
        """:func:`checksum` of one object lying in the engine's pool (``runs`` of :meth:`runs`)."""
        return checksum(self.run_addrs(runs), runs[:, 3])

    def pack_one(self, block_id: int, out) -> None:
        """Write this rank's heads of block ``block_id`` into ``out`` (uint8
        ``[part_nbytes]``, the part's wire bytes: the whole object when :attr:`full`)."""
        from ..kernels import pack

        pack(self.layout, [block_id], heads=self.part, out=out)

    def unpack_many(self, staging, block_ids) -> None:
        """Scatter ``len(block_ids)`` objects lying back to back at the start of
        ``staging`` (uint8) into ``block_ids`` (this rank's heads of each)."""
        from ..kernels import pack, unpack

        n, size = len(block_ids), self.nbytes
        if self.full:
            for i, bid in enumerate(block_ids):
                unpack(self.layout, staging[i * size:(i + 1) * size], [bid], heads=self.heads)
            return
        l = self.layout
        view = staging[:n * size].view(l.dtype).view(n, l.num_layers, 2, l.block_size, self.heads[1], l.head_dim)
        from ..layout import KVLayout

        objects = KVLayout.from_tensors(view, "N L 2 B H D")
        mine = tuple(l.head_range)
        unpack(l, pack(objects, list(range(n)), heads=mine), list(block_ids), heads=mine)
