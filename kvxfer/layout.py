"""``KVLayout``: an engine's own paged-KV tensors plus names for their dims.

A layout never copies or owns memory; it records base addresses and byte
strides of every (layer, kv) *plane* ``[N, B, H, D]`` and answers what the
pack kernels and the transfer layer need: sizes, wire bytes, the byte runs of
blocks in engine memory, the memory regions to register, and a fingerprint.
See ``docs/layout.md`` (dims, presets) and ``docs/wire-format.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import _dims
from .errors import LayoutMismatch

_FP_FIELDS = ("layers", "kv", "heads", "head_dim", "block", "dtype")


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Describes one rank's paged KV pool; build it with :meth:`from_tensors` or a preset.

    Sizes: ``num_layers`` (L), ``num_kv`` (2 for K/V, 1 for MLA), ``num_blocks`` (N),
    ``block_size`` (B, tokens a block), ``num_heads`` (local kv heads, H),
    ``head_dim`` (D, or the MLA latent width C). Global heads are
    ``num_global_heads = num_heads * tp_size``; this rank holds ``head_range``.
    """

    dims: str
    tensors: tuple = field(repr=False)
    planes: tuple = field(repr=False)  # [layer][kv] -> _dims.Plane
    num_layers: int
    num_kv: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    byte_format: str = ""  # engine-specific byte order inside a (block, head, kv) cell; see from_tensors

    # ---- construction -------------------------------------------------------
    @classmethod
    def from_tensors(cls, tensors, dims: str, *, tp_rank: int = 0, tp_size: int = 1,
                     byte_format: str = "") -> "KVLayout":
        """Describe engine tensors by naming their dims (letters ``L 2 N B H D C``, any order).

        ``tensors`` is one tensor, a per-layer list, or, when ``dims`` has no
        ``2`` (and no ``C``), a ``(k, v)`` pair (or ``{"k": .., "v": ..}``) whose
        items are each a tensor or a per-layer list. Strides are read from the
        tensors, so views and padded pools work. Examples::

            KVLayout.from_tensors(per_layer, "2 N B H D")         # vLLM classic
            KVLayout.from_tensors(pool, "N L 2 B H D")            # cross-layer pool
            KVLayout.from_tensors((k_list, v_list), "N B H D")    # separate K/V
            KVLayout.from_tensors(latent_list, "N B C")           # MLA

        ``byte_format``: for pools whose bytes inside a ``[B, D]`` cell are not in the
        order the dims name (e.g. vLLM CPU stores K transposed on some kernel paths),
        a tag naming that order; it joins the fingerprint, so such pools exchange
        blocks only with pools of the same tag (byte for byte, never converted).
        """
        if not isinstance(byte_format, str) or ";" in byte_format or "=" in byte_format:
            raise ValueError(f"byte_format must be a str without ';' or '=', got {byte_format!r}")
        letters = _dims.parse_dims(dims)
        for name, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank} tp_size={tp_size}")
        groups, split_kv = _dims.collect(tensors, letters)
        flat = [t for g in groups for t in g]
        shape = _dims.check_tensors(flat, letters, dims)
        planes, uniq = _dims.make_planes(groups, split_kv, letters, shape)
        is_mla = "C" in letters
        return cls(
            dims=" ".join(letters), tensors=uniq, planes=planes, num_layers=len(planes),
            num_kv=1 if is_mla else 2, num_blocks=shape["N"], block_size=shape["B"],
            num_heads=1 if is_mla else shape["H"], head_dim=shape["C"] if is_mla else shape["D"],
            tp_rank=tp_rank, tp_size=tp_size, byte_format=byte_format,
        )

    @classmethod
    def vllm(cls, kv_caches, *, blocks_first: bool = False, tp_rank: int = 0, tp_size: int = 1):
        """vLLM per-layer caches (list, or the ``{layer_name: tensor}`` dict in order).

        ``[2, N, B, H, D]`` (classic), ``[N, 2, B, H, D]`` with ``blocks_first``,
        ``[N, B, C]`` for MLA. HND variants keep the logical shape and permute the
        strides, which the layout reads, so they need no flag.
        """
        caches = list(kv_caches.values()) if isinstance(kv_caches, dict) else kv_caches
        first = caches if hasattr(caches, "dim") else caches[0]
        dims = "N B C" if first.dim() == 3 else ("N 2 B H D" if blocks_first else "2 N B H D")
        return cls.from_tensors(caches, dims, tp_rank=tp_rank, tp_size=tp_size)

    @classmethod
    def flashinfer(cls, kv_caches, *, kv_layout: str = "NHD", tp_rank: int = 0, tp_size: int = 1):
        """FlashInfer paged caches per layer: ``[N, 2, B, H, D]`` (NHD) or ``[N, 2, H, B, D]``
        (HND), or a ``(k, v)`` pair of per-layer lists of ``[N, B, H, D]`` / ``[N, H, B, D]``."""
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        inner = "B H D" if kv_layout == "NHD" else "H B D"
        split = isinstance(kv_caches, (tuple, dict)) and len(kv_caches) == 2 and not hasattr(kv_caches, "dim")
        split = split and (isinstance(kv_caches, dict) or isinstance(kv_caches[0], (list, tuple))
                           or kv_caches[0].dim() == 4)
        dims = f"N {inner}" if split else f"N 2 {inner}"
        return cls.from_tensors(kv_caches, dims, tp_rank=tp_rank, tp_size=tp_size)

    @classmethod
    def sglang(cls, k_buffers, v_buffers, *, page_size: int, tp_rank: int = 0, tp_size: int = 1):
        """SGLang token pools: per-layer ``[num_tokens, H, D]`` K and V buffers, viewed as
        ``[num_tokens // page_size, page_size, H, D]`` (a trailing partial page is left out)."""
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")

        def paged(bufs):
            out = []
            for t in _dims._as_list(bufs, "k_buffers/v_buffers"):
                if t.dim() != 3 or t.shape[0] < page_size:
                    raise ValueError(f"expected [num_tokens >= page_size, H, D] buffers, got {tuple(t.shape)}")
                usable = (t.shape[0] // page_size) * page_size
                out.append(t[:usable].unflatten(0, (-1, page_size)))
            return out

        return cls.from_tensors((paged(k_buffers), paged(v_buffers)), "N B H D",
                                tp_rank=tp_rank, tp_size=tp_size)

    # ---- sizes --------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.num_kv == 1

    @property
    def dtype(self):
        return self.tensors[0].dtype

    @property
    def itemsize(self) -> int:
        return self.tensors[0].element_size()

    @property
    def device(self):
        return self.tensors[0].device

    @property
    def num_global_heads(self) -> int:
        """Kv heads of the whole model (MLA: 1; its latent is replicated, not split)."""
        return self.num_heads if self.is_mla else self.num_heads * self.tp_size

    @property
    def head_range(self) -> tuple:
        """Global ``(start, stop)`` kv heads held by this rank."""
        if self.is_mla:
            return (0, 1)
        return (self.tp_rank * self.num_heads, (self.tp_rank + 1) * self.num_heads)

    def block_nbytes(self, heads=None) -> int:
        """Wire bytes of one block of one layer, K and V together: ``num_kv * B * h * D * itemsize``."""
        start, stop = self.resolve_heads(heads)
        return self.num_kv * self.block_size * (stop - start) * self.head_dim * self.itemsize

    def wire_shape(self, num_blocks: int, layers=None, heads=None) -> tuple:
        """Logical wire shape ``[layers, kv, blocks, B, heads, D]`` (dtype ``self.dtype``)."""
        start, stop = self.resolve_heads(heads)
        num_layers = self.num_layers if layers is None else len(self.resolve_layers(layers))
        return (num_layers, self.num_kv, num_blocks, self.block_size, stop - start, self.head_dim)

    def wire_nbytes(self, num_blocks: int, layers=None, heads=None) -> int:
        """Total wire bytes; layer slot ``j`` is ``[j, j+1) * num_blocks * block_nbytes(heads)``."""
        num_layers = self.num_layers if layers is None else len(self.resolve_layers(layers))
        return num_layers * num_blocks * self.block_nbytes(heads)

    # ---- argument resolution (validates, touches no memory) -------------------
    def resolve_heads(self, heads) -> tuple:
        """``None`` -> :attr:`head_range`; else a validated global ``(start, stop)`` inside it."""
        own = self.head_range
        if heads is None:
            return own
        if not isinstance(heads, (tuple, list)) or len(heads) != 2:
            raise TypeError(f"heads must be a (start, stop) global head range, got {heads!r}")
        start, stop = heads
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, stop)):
            raise TypeError(f"heads must hold ints, got {heads!r}")
        if not own[0] <= start < stop <= own[1]:
            raise ValueError(
                f"heads {tuple(heads)} is not a non-empty range inside this rank's global heads {own} "
                f"(tp_rank={self.tp_rank}, tp_size={self.tp_size})"
            )
        return (start, stop)

    def resolve_layers(self, layers) -> tuple:
        """``None`` -> all layers; an int or a sequence of distinct in-range ints."""
        if layers is None:
            return tuple(range(self.num_layers))
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        try:
            out = tuple(int(x) if not isinstance(x, bool) and int(x) == x else None for x in layers)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"layers must be None, an int or a sequence of ints, got {layers!r}") from exc
        if any(x is None for x in out):
            raise TypeError(f"layers must hold ints, got {layers!r}")
        if not out:
            raise ValueError("layers is empty")
        bad = [x for x in out if not 0 <= x < self.num_layers]
        if bad:
            raise ValueError(f"layer {bad[0]} out of range [0, {self.num_layers})")
        if len(set(out)) != len(out):
            raise ValueError(f"layers {list(out)} has duplicates")
        return out

    # ---- views, regions, runs -----------------------------------------------
    def kv_view(self, layer: int, kv: int = 0):
        """The ``[N, B, H, D]`` tensor view of one layer's K (``kv=0``) or V (``kv=1``)."""
        import torch

        plane = self.planes[layer][kv]
        base = self.tensors[plane.tensor_index]
        item = self.itemsize
        shape = (self.num_blocks, self.block_size, self.num_heads, self.head_dim)
        offset = base.storage_offset() + plane.offset // item
        return torch.as_strided(base, shape, [s // item for s in plane.strides], offset)

    def regions(self, allocation_range=None) -> tuple:
        """Distinct memory spans ``((address, nbytes), ...)`` covering the pool, sorted.
        Views of one storage share the hull of what they touch; on CUDA, spans are never
        merged across a device allocation boundary (``allocation_range(addr) -> (start,
        size)``, default: the driver's; see :mod:`kvxfer.cuda_ranges`)."""
        from . import runs

        return runs.regions(self, allocation_range)

    def region_parts(self, allocation_range=None) -> tuple:
        """Per region of :meth:`regions`, the ``((address, nbytes), ...)`` pieces to register:
        the region cut at every device allocation boundary inside it (one piece on CPU and
        for ``cudaMalloc`` pools; several where a tensor spans the physical chunks of
        ``expandable_segments``)."""
        from .cuda_ranges import oracle_for, split_parts

        oracle = allocation_range if allocation_range is not None else oracle_for(self.device)
        return split_parts(self.regions(oracle), oracle)

    def block_runs(self, block_ids, *, layers=None, heads=None):
        """Contiguous byte runs of the given blocks, in wire order.

        Returns an int64 numpy array ``[num_runs, 4]``: ``region`` (index into
        :meth:`regions`), ``offset`` (bytes into that region), ``wire_offset``
        (bytes into the pack buffer of these ids/layers/heads) and ``length``.
        Each run is contiguous in engine memory *and* in the wire format, and
        runs adjacent in both are coalesced.
        """
        from . import runs

        return runs.block_runs(self, block_ids, layers=layers, heads=heads)

    # ---- compatibility ------------------------------------------------------
    def fingerprint(self) -> str:
        """Model dims, dtype, block size, global heads (and ``byte_format`` if set);
        not the TP split or the engine layout."""
        values = (self.num_layers, self.num_kv, self.num_global_heads, self.head_dim,
                  self.block_size, str(self.dtype).replace("torch.", ""))
        fp = "kvxfer-v1;" + ";".join(f"{k}={v}" for k, v in zip(_FP_FIELDS, values))
        return fp + (f";format={self.byte_format}" if self.byte_format else "")

    def check_compatible(self, other) -> None:
        """Raise :class:`LayoutMismatch` naming the first differing field (``other``: layout or fingerprint)."""
        theirs = other.fingerprint() if isinstance(other, KVLayout) else other
        if not isinstance(theirs, str):
            raise TypeError(f"expected a KVLayout or a fingerprint string, got {type(other).__name__}")
        mine_f, theirs_f = _parse(self.fingerprint()), _parse(theirs)
        for key in ("version", *_FP_FIELDS, "format"):
            if mine_f.get(key) != theirs_f.get(key):
                raise LayoutMismatch(f"layouts differ in {key}: {mine_f.get(key)} here vs {theirs_f.get(key)}")

    def compatible_with(self, other) -> bool:
        """True when ``other`` (layout or fingerprint) can exchange wire buffers with this one."""
        try:
            self.check_compatible(other)
        except LayoutMismatch:
            return False
        return True

    def head_overlap(self, other) -> tuple | None:
        """Global ``(start, stop)`` heads held by both this rank and ``other`` (None if disjoint)."""
        self.check_compatible(other)
        start = max(self.head_range[0], other.head_range[0])
        stop = min(self.head_range[1], other.head_range[1])
        return (start, stop) if start < stop else None


def _parse(fp: str) -> dict:
    head, _, rest = fp.partition(";")
    out = {"version": head}
    for item in rest.split(";"):
        key, _, value = item.partition("=")
        out[key] = value
    return out
