"""NIXL on the request of ``transfer.py``: the competitor beside kvxfer, same bytes.

Each side registers its pool's regions with a ``nixl_agent`` (UCX backend; ``VRAM`` for
CUDA pools, ``DRAM`` for host ones). The target (D) announces its agent metadata, region
addresses, pool geometry and block ids; the initiator (P) prepares one descriptor per
contiguous run of the request on both sides once -- the runs kvxfer's zero-copy path
posts (:func:`kvxfer.transport.descriptors.zero_copy_descs`), as vLLM's NixlConnector
prepares per-block descriptors at registration -- and each timed iteration is vLLM's
request path: ``make_prepped_xfer`` WRITE with a notification, ``transfer``,
``check_xfer_state`` until ``DONE``, ``release_xfer_handle``. The target counts the
notifications (each arrives after its bytes), then ``transfer.py`` checks them
bitwise. No NIXL progress thread (it spins a core); the target progresses UCX through
``get_new_notifs`` between naps of 50 us.
"""
from __future__ import annotations

import time

import numpy as np

TIMEOUT_S = 120.0
NAP_S = 0.00005


def available() -> bool:
    from kvxfer.bench.nixl import available as importable

    return importable() is not None


def _agent(name: str, layout):
    from kvxfer.bench.nixl import _api

    api = _api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    mem = "VRAM" if layout.device.type == "cuda" else "DRAM"
    dev = layout.device.index or 0
    regions = [list(r) for r in layout.regions()]
    agent.register_memory([(addr, n, dev, "kv") for addr, n in regions], mem)
    return agent, regions, mem, dev


def target(dst, dst_ids, iters: int, announce) -> str:
    """D: register ``dst``, ``announce(info)`` (a JSON-able dict for the initiator), then
    wait for ``iters`` notifications. Returns the path name."""
    from kvxfer.transport.descriptors import Geometry

    agent, regions, _, dev = _agent("kvxfer-gpu-nixl-target", dst)
    announce({"meta": agent.get_agent_metadata().hex(), "regions": regions, "device": dev,
              "geometry": Geometry.from_layout(dst).to_wire(), "ids": list(dst_ids)})
    got, deadline = 0, time.monotonic() + TIMEOUT_S
    while got < iters:
        if time.monotonic() > deadline:
            raise TimeoutError(f"NIXL target: {got} of {iters} notifications in {TIMEOUT_S} s")
        for msgs in agent.get_new_notifs().values():
            got += len(msgs)
        time.sleep(NAP_S)
    return "nixl"


def initiator(src, src_ids, info: dict, iters: int) -> list:
    """P: ``iters`` timed writes of ``src_ids`` into the target's blocks; seconds each."""
    from kvxfer.transport.descriptors import Geometry, zero_copy_descs

    agent, regions, mem, dev = _agent("kvxfer-gpu-nixl-initiator", src)
    remote = agent.add_remote_agent(bytes.fromhex(info["meta"]))
    src_geo, dst_geo = Geometry.from_layout(src), Geometry.from_wire(info["geometry"])
    descs = zero_copy_descs(src_geo, src_ids, dst_geo, info["ids"], tuple(range(src.num_layers)),
                            src.head_range, tuple(range(len(regions))), tuple(range(len(info["regions"]))))
    local = [(regions[r][0] + off, n, dev) for r, off, _, _, n in descs.tolist()]
    far = [(info["regions"][r][0] + off, n, info["device"]) for _, _, r, off, n in descs.tolist()]
    while True:  # the remote agent's metadata is loaded; its connection may come up on first use
        try:
            remote_h = agent.prep_xfer_dlist(remote, far, mem)
            break
        except Exception:  # noqa: BLE001 - NIXL raises its own types; retried until the deadline
            if not locals().get("deadline"):
                deadline = time.monotonic() + 30
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem)
    idx = np.arange(len(local), dtype=np.int32)
    times = []
    try:
        for i in range(iters):
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer("WRITE", local_h, idx, remote_h, idx, notif_msg=f"done-{i}".encode())
            state = agent.transfer(h)
            deadline = time.monotonic() + TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL write not done within {TIMEOUT_S} s")
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL write failed: state {state}")
            times.append(time.perf_counter() - t0)
    finally:
        agent.release_dlist_handle(local_h)
        agent.release_dlist_handle(remote_h)
    return times
