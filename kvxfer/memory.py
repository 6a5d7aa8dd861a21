"""Memory registration: name a few large regions once, then move bytes by offset.

A *region* is an address range registered with the native engine
(``kvxfer._C.Engine``): UCX maps it (``ucp_mem_map``), packs the remote key a
peer needs, and pins host pages with ``mlock`` where the memlock limit allows
(``Region.is_pinned`` says whether it did). Registering a range that an existing
registration of the same device already covers is a cache hit: no UCX call, a
new region id over the same mapping (``Region.is_cached``). Deregistering
invalidates the id at once (descriptors naming it raise
:class:`~kvxfer.errors.InvalidDescriptor`); the mapping is released with its
last region. See ``docs/registration.md``.
"""
from __future__ import annotations

from dataclasses import dataclass

_KINDS = {"cpu": 0, "cuda": 1}
_DEVICES = {v: k for k, v in _KINDS.items()}


@dataclass(frozen=True)
class Region:
    """One registered range ``[addr, addr + length)``; ``region_id`` names it in descriptors."""

    region_id: int
    addr: int
    length: int
    device: str = "cpu"
    device_id: int = 0
    is_pinned: bool = False
    is_cached: bool = False

    @classmethod
    def _from_native(cls, t) -> "Region":
        rid, addr, length, kind, device_id, is_pinned, is_cached = t
        return cls(rid, addr, length, _DEVICES[kind], device_id, bool(is_pinned), bool(is_cached))


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


class MemoryRegistry:
    """Registers memory with one engine; the backend owns it (``backend.registry``)."""

    def __init__(self, engine, *, pin: bool = True):
        self._engine = engine
        self._pin = pin

    def register(self, addr: int, length: int, *, device: str = "cpu", device_id: int = 0,
                 pin: bool | None = None) -> Region:
        """Register ``[addr, addr+length)`` of ``device`` ("cpu" or "cuda"); a covered range is free.

        Raises ``ValueError``/``TypeError`` on bad arguments and
        :class:`~kvxfer.errors.RegistrationError` when the memory cannot be registered.
        """
        _check_int("addr", addr)
        _check_int("length", length)
        _check_int("device_id", device_id)
        if device not in _KINDS:
            raise ValueError(f"device must be one of {sorted(_KINDS)}, got {device!r}")
        if addr <= 0 or length <= 0 or addr + length > 2**64:
            raise ValueError(f"invalid range addr={addr:#x} length={length}")
        if device_id < 0:
            raise ValueError("device_id must be >= 0")
        pin = self._pin if pin is None else pin
        return Region._from_native(self._engine.register(addr, length, _KINDS[device], device_id, bool(pin)))

    def register_tensor(self, tensor, *, pin: bool | None = None) -> Region:
        """Register the storage span of a CPU or CUDA tensor (e.g. a whole KV pool)."""
        from ._dims import tensor_span

        if tensor.numel() == 0:
            raise ValueError("cannot register an empty tensor")
        if any(s < 0 for s in tensor.stride()):
            raise ValueError("tensors with negative strides are not supported")
        addr, nbytes = tensor_span(tensor)
        device = tensor.device.type
        if device not in _KINDS:
            raise ValueError(f"cannot register {device} tensors")
        return self.register(addr, nbytes, device=device, device_id=tensor.device.index or 0, pin=pin)

    def deregister(self, region: Region | int) -> None:
        """Invalidate a region id (``ValueError`` if unknown); its mapping goes with its last region."""
        rid = region.region_id if isinstance(region, Region) else _check_int("region", region)
        self._engine.deregister(rid)

    def regions(self) -> list[Region]:
        """Live regions, by id."""
        return [Region._from_native(t) for t in self._engine.regions()]

    def __len__(self) -> int:
        return len(self._engine.regions())

    def __repr__(self) -> str:
        return f"MemoryRegistry(regions={len(self)})"
