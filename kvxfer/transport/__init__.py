"""Move: backends that carry bytes between registered regions (see :mod:`.base`).

``make_backend(name)`` builds one; UCX is imported only then. What a piece of a
transfer becomes: :mod:`.descriptors` (a peer's pool :class:`~.descriptors.Geometry`
and the coalesced zero-copy descriptors between two pools) and :mod:`.paths` (the
cost model choosing zero-copy or pack, and the pack path's chunks).
"""
from __future__ import annotations

from .base import Backend, Capabilities, Connection
from .paths import CostModel

__all__ = ["Backend", "Capabilities", "Connection", "CostModel", "make_backend", "BACKENDS", "vm_copy_limits",
           "vm_copy_threads"]

BACKENDS = ("auto", "ucx", "vm", "loopback")


def make_backend(name: str | Backend = "auto", listen_host: str | None = None,
                 **options) -> Backend:
    """Return a backend by name (a :class:`Backend` instance is returned as is).

    ``"auto"``: UCX with the same-host ``process_vm_writev`` fast path where the
    kernel permits it; ``"ucx"``: UCX only (even on one host); ``"vm"``: require
    the same-host path (connect raises otherwise); ``"loopback"``: in-process,
    for unit tests. ``options`` go to
    :class:`~kvxfer.transport.ucx.UcxBackend` (e.g. ``pin=False``). With
    ``listen_host`` (an agent's listen address), UCX is narrowed to the network
    devices holding it, so the agent listens on nothing beyond that address.
    """
    if isinstance(name, Backend):
        return name
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    if name == "loopback":
        from .loopback import LoopbackBackend

        return LoopbackBackend(**options)
    from .ucx import UcxBackend

    if listen_host is not None:
        from .netdev import net_devices_for

        options.setdefault("net_devices", net_devices_for(listen_host))
    if name == "ucx":
        return UcxBackend(allow_vm=False, **options)
    if name == "vm":
        return UcxBackend(require_vm=True, **options)
    return UcxBackend(**options)


def vm_copy_limits() -> dict:
    """The same-host (``vm``) copy pool's built-in numbers, from csrc/vm_copy.h.

    ``{"default_threads": n, "max_threads": n, "split_bytes": n}``: copying threads
    of one batch by default (``min(cores, default_threads)``), their cap, and the
    batch size from which a batch is split across them. ``AgentConfig.copy_threads``
    and ``vm_split_bytes`` override the first and last.
    """
    from .._native import load

    C = load()
    return {"default_threads": C.VM_DEFAULT_THREADS, "max_threads": C.VM_MAX_THREADS,
            "split_bytes": C.VM_SPLIT_BYTES}


def vm_copy_threads(copy_threads: int | None, cores: int) -> int:
    """Copying threads (the caller included) of one split same-host batch that
    ``AgentConfig.copy_threads`` (None: the default) gives on ``cores`` cores: csrc's
    rule (``min(cores, default_threads)``, capped at ``max_threads``), asked of
    ``kvxfer._C``."""
    from .._native import load

    return load().vm_resolve_threads(copy_threads or 0, cores)
