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
* a rank of a TP group holds ``head_range`` only; its get reads whole objects and
  keeps its heads (the staging bytes are described as a ``"N L 2 B H D"`` pool and
  copied with ``pack(heads=...)`` -> ``unpack(heads=...)``). Its put is refused
  (``ValueError``): an object must hold every head, so a TP group pools through one
  rank per group that holds all heads, or not at all.
"""
from __future__ import annotations

import hashlib

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

    ``nbytes``: bytes of one object; ``fmt``: a tag of the model fingerprint (a node
    only returns an object to a get quoting the tag it was put with); ``full``: this
    rank holds every kv head (it may put).
    """

    def __init__(self, layout) -> None:
        from ..layout import KVLayout

        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a kvxfer.KVLayout, got {type(layout).__name__}")
        if layout.device.type != "cpu":
            raise ValueError("the store moves host pools only (a CUDA pool: stage it through host memory)")
        self.layout = layout
        self.heads = (0, layout.num_global_heads)
        self.full = tuple(layout.head_range) == self.heads
        self.nbytes = (layout.num_layers * layout.num_kv * layout.block_size * self.heads[1] * layout.head_dim
                       * layout.itemsize)
        self.fmt = hashlib.blake2b(layout.fingerprint().encode(), digest_size=16).hexdigest()
        self.bases = [a for a, _ in layout.regions()]
        self._runs: dict = {}
        self.zero_copy = self.full and self.nbytes // len(self.runs(0)) >= ZERO_COPY_MIN_RUN

    def runs(self, block_id: int):
        """int64 ``[num_runs, 4]`` of block ``block_id``: pool region index, offset in it,
        offset in the object, length (see :meth:`KVLayout.block_runs`); computed once per block."""
        got = self._runs.get(block_id)
        if got is None:
            got = self._runs[block_id] = self.layout.block_runs([block_id], heads=self.heads)
        return got

    def run_addrs(self, runs):
        """int64 ``[num_runs]``: the address of each run of :meth:`runs` in the pool."""
        import numpy as np

        return np.asarray(self.bases, np.int64)[runs[:, 0]] + runs[:, 1]

    def checksum_runs(self, runs) -> int:
        """:func:`checksum` of one object lying in the engine's pool (``runs`` of :meth:`runs`)."""
        return checksum(self.run_addrs(runs), runs[:, 3])

    def check_put(self) -> None:
        """``ValueError`` unless this rank holds every head (only then may it put)."""
        if not self.full:
            l = self.layout
            raise ValueError(f"put needs a layout holding every kv head; this rank holds heads "
                             f"{tuple(l.head_range)} of {self.heads} (tp_rank={l.tp_rank}, tp_size={l.tp_size})")

    def pack_one(self, block_id: int, out) -> None:
        """Write block ``block_id``'s object into ``out`` (uint8 ``[nbytes]``)."""
        from ..kernels import pack

        self.check_put()
        pack(self.layout, [block_id], heads=self.heads, out=out)

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
