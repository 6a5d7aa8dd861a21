"""Checks shared by every pack/unpack path (all run before memory is touched)."""
from __future__ import annotations

from ..runs import tile_copy, normalize_ids

# same-size integer dtype per itemsize: lets torch index/copy any dtype (fp8 too) bit-exactly
INT_DTYPE_NAMES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def device_guard(device):
    """``torch.cuda.device(device)`` for a CUDA device, else a no-op context: every launch and
    allocation kvxfer makes for a pool runs under its device, whatever the calling thread's
    current device is (agent threads start on device 0)."""
    if device.type != "cuda":
        import contextlib

        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def check_layout(layout) -> None:
    if type(layout) is _LAYOUT[0]:  # the hot path: one type check, no import
        return
    from ..layout import KVLayout

    _LAYOUT[0] = KVLayout
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a kvxfer.KVLayout, got {type(layout).__name__}")


_LAYOUT: list = [None]  # kvxfer.KVLayout once check_layout imported it


def prepare_pack(layout, block_ids, layers, heads, out):
    """Validate a pack call -> (job, out buffer uint8 [job.nbytes])."""
    import torch

    check_layout(layout)
    job = tile_copy(layout, block_ids, layers=layers, heads=heads, unique=False)
    if out is None:
        with device_guard(layout.device):
            return job, torch.empty(job.nbytes, dtype=torch.uint8, device=layout.device)
    check_buffer(layout, job.nbytes, out, "out")
    return job, out.reshape(-1)[: job.nbytes]


def prepare_unpack(layout, buf, block_ids, layers, heads):
    """Validate an unpack call -> (job, wire bytes uint8 [job.nbytes])."""
    check_layout(layout)
    job = tile_copy(layout, block_ids, layers=layers, heads=heads, unique=True)
    check_buffer(layout, job.nbytes, buf, "buf")
    return job, buf.reshape(-1)[: job.nbytes]


def resolve(layout, block_ids, layers, heads, *, unique: bool) -> tuple:
    """Validate a call without building its tile copy -> (ids int64 numpy [n], layers tuple, heads tuple, nbytes)."""
    check_layout(layout)
    ids = normalize_ids(block_ids, layout.num_blocks, unique=unique)
    layers = layout.resolve_layers(layers)
    heads = layout.resolve_heads(heads)
    return ids, layers, heads, len(layers) * ids.size * layout.block_nbytes(heads)


def check_buffer(layout, nbytes: int, buf, name: str) -> None:
    import torch

    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"{name} must be a uint8 tensor (wire bytes), got {buf.dtype}")
    if buf.device != layout.device:
        raise ValueError(f"{name} is on {buf.device} but the KV pool is on {layout.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if buf.numel() < nbytes:
        raise ValueError(f"{name} holds {buf.numel()} bytes but the wire format needs {nbytes}")
