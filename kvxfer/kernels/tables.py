"""Launch tables of the Triton kernel, built once per pool and kept on its device.

Per ``(layout, heads)`` the geometry of *every* layer's planes is computed once
(:func:`kvxfer.runs.tile_copy` over all layers): row and tile sizes, per-plane
origin, block stride and outer strides. The kernel reads them from an int64
``[planes, 5]`` table of word offsets on the pool's device, built once per
``(heads, word)``; a call for layers ``a..b`` (ascending, consecutive: every
``send_layer``) uses a row slice of it (a view, no copy), any other selection a
gathered table cached per layer tuple. Block ids live on the device too,
cached per contents (a request's ids serve all its layers). So a call does no
numpy work and, after the first call of a request, no host->device copy;
a miss copies through pinned memory with ``non_blocking=True``.

A call itself is cached too (:meth:`PoolTables.plan`): block ids given as a list or
tuple of ints, a numpy array or a host tensor, with ``layers``/``heads`` given as None, ints
or tuples of ints, key a :class:`Plan` holding what validation found and the device
tensors of that call, so a repeated call (every layer of a request, every retry of a
chunk) validates nothing again and builds nothing.

Cached device tensors remember the stream that built them; a launch on another
stream first waits for that build (``wait_event``) and marks the tensor used
there (``record_stream``), so neither a stale read nor an early reuse of its
memory can happen. Caches are bounded and shared by the agent's threads (locked).
"""
from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass

import numpy as np

from ..runs import tile_copy

MAX_IDS = 256  # cached block-id tensors per pool
MAX_TABLES = 64  # cached gathered tables per pool
MAX_PLANS = 256  # cached calls per pool
_INTS = {int}


@dataclass(frozen=True)
class PlaneTable:
    """Host table of every plane (all layers, K/V) for one head range, and the sizes the kernel needs."""

    row_bytes: int
    tile_bytes: int
    outer_sizes: tuple
    table_bytes: np.ndarray  # int64 [L * kv, 5]: origin (absolute), block stride, outer strides 0..2
    base: int  # lowest storage address of the pool: table origins are offsets from it
    base_nbytes: int
    align: int  # gcd of base, origins, strides and row bytes


class _Entry:
    __slots__ = ("tensor", "event", "stream", "raw")

    def __init__(self, tensor, event, stream) -> None:
        self.tensor, self.event, self.stream = tensor, event, stream
        self.raw = stream.cuda_stream if stream is not None else 0  # the building stream's handle


class Plan:
    """One validated call: ``ids`` (int64 numpy ``[n]``), ``layers`` and ``heads`` (resolved
    tuples), ``nbytes`` (wire bytes), and ``by_word``: per direction and wire alignment the
    launch (device table and ids entries, the compiled kernel; :mod:`kvxfer.kernels.triton_pack`);
    ``copies``: per destination plan, the pool-to-pool launch (:mod:`kvxfer.kernels.triton_copy`).
    Plans hash by identity."""

    __slots__ = ("ids", "layers", "heads", "nbytes", "by_word", "copies")

    def __init__(self, ids, layers, heads, nbytes) -> None:
        self.ids, self.layers, self.heads, self.nbytes = ids, layers, heads, nbytes
        self.by_word: dict = {}
        self.copies: dict = {}


def _int_tuple(value):
    """``value`` as a hashable key when it is None, an int or a list/tuple of exact ints; else None."""
    if value is None:
        return ("all",)
    t = type(value)
    if t is int:
        return ("int", value)
    if (t is list or t is tuple) and (not value or set(map(type, value)) == _INTS):
        return ("seq", *value)
    return None


def call_key(block_ids, layers, heads, unique: bool):
    """The cache key of a pack/unpack call, or None when its arguments are not cacheable
    (device tensors, ranges, scalars, numpy integers inside lists: those validate every time).
    Exact types are part of the key (``1.0`` or ``True`` never meets a cached ``1``)."""
    t = type(block_ids)
    if t is list or t is tuple:
        if block_ids and set(map(type, block_ids)) != _INTS:
            return None
        ids_key = ("seq", tuple(block_ids))
    elif t is np.ndarray:
        ids_key = ("array", block_ids.dtype.str, block_ids.shape, block_ids.tobytes())
    elif t.__module__.startswith("torch") and getattr(block_ids, "device", None) is not None \
            and block_ids.device.type == "cpu" and not block_ids.requires_grad:
        try:
            arr = block_ids.numpy()  # a host tensor's bytes, no copy (a device tensor would sync: not cached)
        except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16 ...): invalid ids anyway
            return None
        ids_key = ("array", arr.dtype.str, arr.shape, arr.tobytes())
    else:
        return None
    layers_key, heads_key = _int_tuple(layers), _int_tuple(heads)
    if layers_key is None or heads_key is None:
        return None
    return ids_key, layers_key, heads_key, unique


class PoolTables:
    """The caches of one layout (``PoolTables.of(layout)``)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.device = layout.device
        self.cuda = layout.device.type == "cuda"
        self._lock = threading.Lock()
        self._plane_tables: dict = {}
        self._tables: dict = {}  # (heads, word) -> _Entry (all planes); (heads, word, layers) -> _Entry
        self._ids: collections.OrderedDict = collections.OrderedDict()
        self._words: dict = {}  # word bytes -> one-word tensor at the pool's base
        self._plans: collections.OrderedDict = collections.OrderedDict()  # call key -> Plan
        storages = [t.untyped_storage() for t in layout.tensors]
        self._base_storage = min(storages, key=lambda s: s.data_ptr())

    @classmethod
    def of(cls, layout) -> "PoolTables":
        tables = layout.__dict__.get("_kvx_tables")
        if tables is None:
            tables = layout.__dict__.setdefault("_kvx_tables", cls(layout))
        return tables

    # ---- geometry ---------------------------------------------------------------------
    def plane_table(self, heads: tuple) -> PlaneTable:
        got = self._plane_tables.get(heads)
        if got is None:
            got = self._make_plane_table(heads)
            with self._lock:
                self._plane_tables[heads] = got
        return got

    def _make_plane_table(self, heads: tuple) -> PlaneTable:
        p = tile_copy(self.layout, [0], heads=heads)
        table = np.concatenate([p.plane_addrs[:, None], p.block_strides[:, None], p.outer_strides], axis=1)
        base = self._base_storage.data_ptr()
        align = 0
        for q in (base, p.row_bytes, *table.reshape(-1).tolist()):
            align = math.gcd(align, int(q))
        return PlaneTable(p.row_bytes, p.tile_bytes, p.outer_sizes, np.ascontiguousarray(table), base,
                          self._base_storage.nbytes(), align)

    def pool_words(self, word: int, word_dtype):
        """A one-word tensor at the pool's base storage, typed ``word_dtype`` (the kernel's base pointer)."""
        got = self._words.get(word)
        if got is None:
            import torch

            got = torch.empty(0, dtype=word_dtype, device=self.device).set_(self._base_storage, 0, (1,), (1,))
            self._words[word] = got
        return got

    # ---- calls ------------------------------------------------------------------------
    def plan(self, block_ids, layers, heads, *, unique: bool) -> Plan:
        """The validated :class:`Plan` of a call (cached when :func:`call_key` allows).
        Raises what :func:`kvxfer.kernels.common.resolve` raises; nothing is cached then."""
        key = call_key(block_ids, layers, heads, unique)
        plan = self._plans.get(key) if key is not None else None
        if plan is not None:
            return plan
        from .common import resolve

        plan = Plan(*resolve(self.layout, block_ids, layers, heads, unique=unique))
        if key is not None:
            with self._lock:
                self._plans[key] = plan
                while len(self._plans) > MAX_PLANS:
                    self._plans.popitem(last=False)
        return plan

    # ---- device tensors ---------------------------------------------------------------
    def table_entry(self, heads: tuple, word: int, layers: tuple, stream):
        """``(entry, tensor)``: the device int64 ``[len(layers) * kv, 5]`` table in words for
        the selected layers, in order (the entry's own tensor or a row slice of it, for
        consecutive layers), built on ``stream`` if missing; :meth:`_use` marks it used on
        another stream."""
        kv = self.layout.num_kv
        full = self._tables.get((heads, word))
        if full is None:
            ptable = self.plane_table(heads)
            words = ptable.table_bytes.copy()
            words[:, 0] -= ptable.base
            full = self._upload((heads, word), words // word, stream)
        first, count = layers[0], len(layers)
        if layers == tuple(range(first, first + count)):
            return full, full.tensor[first * kv:(first + count) * kv]
        key = (heads, word, layers)
        entry = self._tables.get(key)
        if entry is None:
            rows = np.array([l * kv + k for l in layers for k in range(kv)], dtype=np.int64)
            ptable = self.plane_table(heads)
            words = ptable.table_bytes[rows].copy()
            words[:, 0] -= ptable.base
            if len(self._tables) >= MAX_TABLES:
                with self._lock:
                    for k in [k for k in self._tables if len(k) == 3]:
                        del self._tables[k]
            entry = self._upload(key, words // word, stream)
        return entry, entry.tensor

    def ids_entry(self, ids: np.ndarray, stream) -> _Entry:
        """The cache entry of the device int64 ``[n]`` copy of ``ids`` (cached by contents,
        LRU), built on ``stream`` if missing; :meth:`_use` marks it used on another stream."""
        key = ids.tobytes()
        entry = self._ids.get(key)
        if entry is None:
            entry = self._make(ids, stream)
            with self._lock:
                self._ids[key] = entry
                while len(self._ids) > MAX_IDS:
                    self._ids.popitem(last=False)
        else:
            with self._lock:
                if key in self._ids:
                    self._ids.move_to_end(key)
        return entry

    def _upload(self, key, host: np.ndarray, stream) -> _Entry:
        entry = self._make(np.ascontiguousarray(host, dtype=np.int64), stream)
        with self._lock:
            self._tables[key] = entry
        return entry

    def _make(self, host: np.ndarray, stream) -> _Entry:
        import torch

        if not self.cuda:
            return _Entry(torch.from_numpy(host.copy()), None, None)
        pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
        pinned.numpy()[...] = host
        tensor = pinned.to(self.device, non_blocking=True)  # on `stream`, the current one
        event = torch.cuda.Event()
        event.record(stream)
        return _Entry(tensor, event, stream)

    @staticmethod
    def _use(entry: _Entry, stream):
        if entry.stream is not None and stream != entry.stream:
            stream.wait_event(entry.event)
            entry.tensor.record_stream(stream)
        return entry.tensor
