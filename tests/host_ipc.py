"""CUDA IPC's stand-in for host pools of one process, and a device that uses it.

:class:`HostIpc` implements what :mod:`kvxfer.transport.cuda_peer` asks of
:class:`~kvxfer.transport.cuda_peer.CudaIpc`: an "allocation" is a tensor storage the
test registered, its "handle" names that storage by address and size, and opening it
returns the same memory (one process: no real mapping). It counts opens and closes,
and can lie about sizes or fail, so the mapping's caching, invalidation and bounds
checks are tested without a GPU. :class:`HostPeerDevice` runs pool-to-pool copies
through the Triton kernel (in the interpreter), standing for the one-launch GPU copy.
"""
from __future__ import annotations

import collections
import struct

from kvxfer.kernels.device import HostDevice
from kvxfer.transport.cuda_peer import HANDLE_BYTES, PeerMapError


class HostIpc:
    def __init__(self) -> None:
        self.allocations: dict = {}  # start -> size
        self.opens: collections.Counter = collections.Counter()  # start -> times opened
        self.closes: collections.Counter = collections.Counter()
        self.shrink = 0  # open() reports allocations this many bytes smaller than they are
        self.fail_open = False
        self.fail_export = False

    def add_layout(self, layout) -> None:
        """Every storage of ``layout`` becomes an exportable allocation."""
        for t in layout.tensors:
            s = t.untyped_storage()
            self.allocations[s.data_ptr()] = s.nbytes()

    def allocation(self, addr: int) -> tuple:
        for start, size in self.allocations.items():
            if start <= addr < start + size:
                return start, size
        raise PeerMapError(f"no allocation holds {addr:#x}")

    def export(self, addr: int, index: int = 0) -> tuple:
        if self.fail_export:
            raise PeerMapError("export refused (test)")
        start, size = self.allocation(addr)
        return struct.pack("<QQ", start, size).ljust(HANDLE_BYTES, b"\0"), start, size

    def open(self, handle: bytes, index: int = 0) -> tuple:
        if self.fail_open:
            raise PeerMapError("open refused (test)")
        start, size = struct.unpack_from("<QQ", handle)
        self.opens[start] += 1
        return start, size - self.shrink

    def close(self, addr: int, index: int = 0) -> None:
        self.closes[addr] += 1

    def device_uuid(self, index: int) -> str:
        return "host"

    @property
    def mapped(self) -> int:
        """Allocations opened and not closed yet."""
        return sum(self.opens.values()) - sum(self.closes.values())


class HostPeerDevice(HostDevice):
    """A host device whose pools are offered to same-node peers through ``ipc``; copies run
    the Triton pool-to-pool kernel (``TRITON_INTERPRET=1``) and are counted in ``copies``."""

    copy_backend = "triton"

    def __init__(self, ipc: HostIpc) -> None:
        self.ipc = ipc
        self.copies = 0

    def copy_blocks(self, src, src_ids, dst, dst_ids, layers, heads, after=()):
        self.copies += 1
        return super().copy_blocks(src, src_ids, dst, dst_ids, layers, heads, after)
