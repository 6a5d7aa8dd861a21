"""Registering the pool and describing it to peers (the INFO exchanged at handshake).

:func:`register_pool` registers each region of a layout (in parts that stay inside
one device allocation, :mod:`.parts`) and the two staging buffers, once; what it
registered is released again if any step fails. :func:`local_info` is this agent's
INFO; :func:`parse_info` checks a peer's against our own geometry.
"""
from __future__ import annotations

from ..cuda_ranges import oracle_for, split_parts
from ..errors import KVXferError, ProtocolError, RegistrationError
from ..kernels.common import device_guard
from ..transport.descriptors import Geometry
from .parts import from_wire as parts_from_wire
from .parts import register_parts, to_wire as parts_to_wire
from .staging import StagingRing
from .state import AgentState, Pool


def register_pool(state: AgentState, layout) -> Pool:
    """Register ``layout``'s pool and two ``staging_bytes`` buffers on its device; raises
    :class:`RegistrationError` (nothing stays registered) on failure."""
    import torch

    backend, nbytes = state.backend, state.staging_bytes
    registered: list = []
    kind, index = layout.device.type, layout.device.index or 0

    def register(addr, length):
        rid = backend.register(addr, length, device=kind, device_id=index)
        registered.append(rid)
        return rid

    try:
        region_ids, region_parts, _ = register_parts(register, layout.region_parts())
        with device_guard(layout.device):  # agent threads must not default to device 0
            stage_in_t = torch.empty(nbytes, dtype=torch.uint8, device=layout.device)
            stage_out_t = torch.empty(nbytes, dtype=torch.uint8, device=layout.device)
        stage = [(t.data_ptr(), t.numel()) for t in (stage_in_t, stage_out_t)]
        stage_ids, stage_parts, _ = register_parts(register, split_parts(stage, oracle_for(layout.device)))
    except Exception as exc:
        for rid in registered:
            backend.deregister(rid)
        if isinstance(exc, KVXferError):
            raise
        raise RegistrationError(f"cannot register the KV pool: {exc}") from exc
    return Pool(layout=layout, geometry=Geometry.from_layout(layout), region_ids=region_ids,
                registered=registered, parts={**region_parts, **stage_parts}, stage_in_t=stage_in_t,
                stage_out_t=stage_out_t, stage_in_region=stage_ids[0], stage_out_region=stage_ids[1],
                stage_in=StagingRing(nbytes), stage_out=StagingRing(nbytes))


def local_info(state: AgentState) -> dict:
    """This agent's INFO (sent only after the peer authenticated)."""
    layout, pool = {}, state.pool
    if pool is not None:
        layout = {"geometry": pool.geometry.to_wire(), "regions": pool.region_ids,
                  "stage_region": pool.stage_in_region, "parts": parts_to_wire(
                      {r: p for r, p in pool.parts.items() if r != pool.stage_out_region})}
    return {"name": state.name, "agent_id": state.agent_id, "layout": layout,
            "backend": state.backend.metadata(), "staging": state.staging_bytes}


def parse_info(state: AgentState, fields: dict) -> dict:
    """A peer's INFO as ``Peer`` fields; ProtocolError if malformed, LayoutMismatch if
    its geometry cannot exchange blocks with ours."""
    layout = fields["layout"]
    out = {"geometry": None, "regions": [], "stage_region": 0, "staging": fields["staging"], "parts": {}}
    if layout:
        try:
            geometry = Geometry.from_wire(layout["geometry"])
            regions, stage = layout["regions"], layout["stage_region"]
            ok = (set(layout) == {"geometry", "regions", "stage_region", "parts"} and type(stage) is int
                  and type(regions) is list and all(type(r) is int for r in regions)
                  and len(regions) == len(geometry.region_sizes) and type(fields["staging"]) is int)
            if ok:
                sizes = dict(zip(regions, geometry.region_sizes))
                sizes[stage] = fields["staging"]
                out["parts"] = parts_from_wire(layout["parts"], sizes)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ProtocolError("invalid layout in INFO")
        if state.geometry is not None:
            state.geometry.check_compatible(geometry)
        out.update(geometry=geometry, regions=regions, stage_region=stage)
    return out
