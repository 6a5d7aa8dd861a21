"""The two paths of a piece and how the pack path is cut.

* **zero-copy** -- one descriptor per contiguous run (:mod:`.descriptors`),
  straight from P's pool into D's pool.
* **pack** -- gather on P into wire format, one write into D's staging ring,
  scatter on D; chosen when runs are short (e.g. NHD <-> HND: ``D`` elements),
  in chunks of at most half the smaller staging buffer (:func:`pack_chunks`).

:class:`CostModel` compares ``descs * per_desc_us`` with the pack/unpack time
plus the staging round trip; a GPU pool uses :func:`device_cost` unless
``AgentConfig.cost_model`` is set. Both paths move identical bytes to identical places.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Microseconds per path; zero-copy wins unless its runs are short. A frozen value
    (``AgentConfig.cost_model``); every field a finite number, ``pack_gbps`` above 0."""

    per_desc_us: float = 1.0  # backend's per-descriptor cost (Capabilities)
    pack_gbps: float = 4.0  # gather (and again scatter) rate on this host
    # the staging grant round trip plus the extra worker hand-offs of the pack path;
    # measured 0.5-2 ms per small pack request on a loaded 2-core host
    stage_rtt_us: float = 500.0

    def __post_init__(self) -> None:
        for name in ("per_desc_us", "pack_gbps", "stage_rtt_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"CostModel.{name} must be a number, got {value!r}")
            if not 0 <= value < math.inf or (name == "pack_gbps" and value == 0):
                raise ValueError(f"CostModel.{name} must be finite and >= 0 (pack_gbps > 0), got {value!r}")

    def zero_copy_us(self, num_descs: int) -> float:
        return num_descs * self.per_desc_us

    def pack_us(self, nbytes: int) -> float:
        return 2 * nbytes / (self.pack_gbps * 1e3) + self.stage_rtt_us

    def choose(self, num_descs: int, nbytes: int) -> str:
        return "zero_copy" if self.zero_copy_us(num_descs) <= self.pack_us(nbytes) else "pack"


# GPU pools (benchmarks/results/gpu_check_h200.txt, H200, one host): the pack path's
# Triton kernels move 1,830-2,040 GB/s (half of that is taken here), and UCX's cuda_ipc
# lane costs ~7 us per put (a 2,048-token Llama-3-8B request, 8,192 puts of 32 KiB:
# 55.7-68.7 ms zero-copy against 5.6 ms packed in 32 MiB chunks, ~0.7 ms a chunk).
CUDA_PACK_GBPS = 1000.0
CUDA_IPC_PER_DESC_US = 6.8
CUDA_STAGE_RTT_US = 700.0


def device_cost(host: CostModel, device_transport: str) -> CostModel:
    """The cost model of a GPU pool's pieces: ``host``'s per-descriptor cost (at least
    cuda_ipc's when ``device_transport`` is ``"ucx:cuda_ipc"``), GPU pack rates and the
    chunk round trip measured on one."""
    per_desc = host.per_desc_us
    if device_transport == "ucx:cuda_ipc":
        per_desc = max(per_desc, CUDA_IPC_PER_DESC_US)
    return CostModel(per_desc_us=per_desc, pack_gbps=CUDA_PACK_GBPS, stage_rtt_us=CUDA_STAGE_RTT_US)


def pack_chunks(num_ids: int, layers: tuple, tile_nbytes: int, max_nbytes: int) -> list:
    """Split a pack transfer into ``(layers, id_slice)`` pieces of at most ``max_nbytes``.

    ``tile_nbytes`` is the wire size of one block of one layer (K and V).
    """
    if tile_nbytes > max_nbytes:
        raise ValueError(f"one block-layer ({tile_nbytes} B) exceeds the staging chunk ({max_nbytes} B)")
    per_layer = num_ids * tile_nbytes
    if per_layer <= max_nbytes:
        step = max(1, max_nbytes // per_layer)
        return [(layers[i:i + step], slice(0, num_ids)) for i in range(0, len(layers), step)]
    step = max_nbytes // tile_nbytes
    return [((layer,), slice(i, min(i + step, num_ids)))
            for layer in layers for i in range(0, num_ids, step)]
