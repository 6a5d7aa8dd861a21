"""The pools of ``kvxfer bench e2e`` and the check of what lands in them.

P's pool (one per prefill TP rank) is filled with seeded random bytes, so any
process can rebuild it; D's pools start zeroed. :class:`Expected` rebuilds P's
pools in D's process once, keeps the bytes each D rank must receive (packed in
the wire format, per overlapping head range), and after each request compares
D's blocks with them bitwise (``torch.equal``). Only the public layout API is used.

Pool shape per rank, by ``--layout`` name (letters as in :class:`kvxfer.KVLayout`;
``H`` is the rank's share of the kv heads, ``N`` = ``pool_blocks``)::

    nhd          [2, N, B, H, D] per layer
    hnd          [N, 2, H, B, D] per layer
    blocks-first [N, 2, B, H, D] per layer
    cross        [N, L, 2, B, H, D] one tensor
"""
from __future__ import annotations

import random

MODELS = {  # layers, kv heads (whole model), head dim
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (80, 8, 128),
    "smollm2-135m": (30, 3, 64),
}
LAYOUTS = {"nhd": "2 N B H D", "hnd": "N 2 H B D", "blocks-first": "N 2 B H D", "cross": "N L 2 B H D"}


def make_layout(spec: dict, which: str, rank: int, fill: bool):
    """A pool of ``spec["pool_blocks"]`` blocks for side ``which`` ("p" or "d") and TP
    ``rank``; ``fill``: seeded random bytes (distinct per layer and rank), else zeros;
    ``spec["memory"]`` "shared": :func:`kvxfer.shared_empty` memory, else ``torch.empty``."""
    import torch

    from .. import KVLayout, shared_empty

    dims = LAYOUTS[spec[f"{which}_layout"]]
    tp = spec[f"{which}_tp"]
    sizes = {"L": spec["layers"], "N": spec["pool_blocks"], "2": 2, "B": spec["block_size"],
             "H": spec["heads"] // tp, "D": spec["head_dim"]}
    shape = [sizes[c] for c in dims.split()]
    dtype = getattr(torch, spec["dtype"])
    count = 1 if "L" in dims else spec["layers"]
    tensors = []
    for layer in range(count):
        t = shared_empty(shape, dtype) if spec.get("memory") == "shared" else torch.empty(shape, dtype=dtype)
        raw = t.view(torch.uint8).view(-1)
        if fill:
            torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1000 * rank + layer), out=raw)
        else:
            raw.zero_()
        tensors.append(t)
    return KVLayout.from_tensors(tensors if count > 1 else tensors[0], dims, tp_rank=rank, tp_size=tp)


def block_ids(spec: dict, seed: int) -> list:
    """``spec["blocks"]`` distinct block ids of the pool in random order (P: seed 1, D: 2)."""
    return random.Random(seed).sample(range(spec["pool_blocks"]), spec["blocks"])


def clear(layout, ids=None) -> None:
    """Zero a pool (``ids`` None) or the given blocks of it, so stale bytes cannot pass."""
    for layer in range(layout.num_layers):
        for kv in range(layout.num_kv):
            view = layout.kv_view(layer, kv)
            if ids is None:
                view.zero_()
            else:
                for block in ids:
                    view[block].zero_()


class Expected:
    """What each D rank must hold after a request: P's bytes, per overlapping head range.

    ``parts[d]`` is a list of ``(heads, wire, first)``: ``heads`` a global ``(lo, hi)``
    kv-head range shared by D rank ``d`` and one P rank; ``wire`` that P rank's blocks
    ``src_ids`` packed for those heads (uint8 ``[layout.wire_nbytes(len(src_ids), heads=heads)]``),
    ``first`` the same for ``src_ids[:1]`` (the round-trip phase's 1-block requests).
    """

    def __init__(self, spec: dict, d_layouts: list, src_ids: list):
        from ..kernels import pack

        self.parts: list = [[] for _ in d_layouts]
        for p_rank in range(spec["p_tp"]):
            p_layout = make_layout(spec, "p", p_rank, fill=True)
            for d, d_layout in enumerate(d_layouts):
                heads = p_layout.head_overlap(d_layout)
                if heads is not None:
                    self.parts[d].append((heads, pack(p_layout, src_ids, heads=heads),
                                          pack(p_layout, src_ids[:1], heads=heads)))
            del p_layout  # only the packed bytes are kept
        if any(not parts for parts in self.parts):
            raise ValueError("a decode rank shares no kv heads with any prefill rank")

    def mismatch(self, d_layouts: list, dst_ids: list, *, first: bool = False) -> str | None:
        """None when every D rank's blocks ``dst_ids`` hold exactly P's bytes (``first``:
        the 1-block request's), else a description of the first difference."""
        import torch

        from ..kernels import pack

        for d, (layout, parts) in enumerate(zip(d_layouts, self.parts)):
            for heads, wire, one in parts:
                want = one if first else wire
                got = pack(layout, dst_ids, heads=heads)
                if not torch.equal(got, want):
                    bad = int((got != want).nonzero()[0])
                    return f"decode rank {d}, heads {heads}: wire byte {bad} of {want.numel()} differs"
        return None
