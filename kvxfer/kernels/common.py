"""Checks shared by every pack/unpack path (all run before memory is touched)."""
from __future__ import annotations

from ..runs import CopyPlan, make_plan

# same-size integer dtype per itemsize: lets torch index/copy any dtype (fp8 too) bit-exactly
INT_DTYPE_NAMES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def check_layout(layout) -> None:
    from ..layout import KVLayout

    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a kvxfer.KVLayout, got {type(layout).__name__}")


def plan_pack(layout, block_ids, layers, heads, out):
    """Validate a pack call -> (plan, out buffer uint8 [plan.nbytes])."""
    import torch

    check_layout(layout)
    plan = make_plan(layout, block_ids, layers=layers, heads=heads, unique=False)
    if out is None:
        return plan, torch.empty(plan.nbytes, dtype=torch.uint8, device=layout.device)
    _check_buffer(layout, plan, out, "out")
    return plan, out.reshape(-1)[: plan.nbytes]


def plan_unpack(layout, buf, block_ids, layers, heads):
    """Validate an unpack call -> (plan, wire bytes uint8 [plan.nbytes])."""
    check_layout(layout)
    plan = make_plan(layout, block_ids, layers=layers, heads=heads, unique=True)
    _check_buffer(layout, plan, buf, "buf")
    return plan, buf.reshape(-1)[: plan.nbytes]


def _check_buffer(layout, plan: CopyPlan, buf, name: str) -> None:
    import torch

    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"{name} must be a uint8 tensor (wire bytes), got {buf.dtype}")
    if buf.device != layout.device:
        raise ValueError(f"{name} is on {buf.device} but the KV pool is on {layout.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if buf.numel() < plan.nbytes:
        raise ValueError(f"{name} holds {buf.numel()} bytes but the wire format needs {plan.nbytes}")
