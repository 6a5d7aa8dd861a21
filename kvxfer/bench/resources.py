"""Which copy resources a measured path uses, so its memcpy limit can use the same.

A path's bytes are copied by:

- ``vm`` (``process_vm_writev``): the posting thread plus the vm copy pool's helpers
  for one batch of at least ``KVXFER_VM_SPLIT_BYTES`` (default 4 MiB; 0: never
  split); ``KVXFER_VM_THREADS`` copying threads in all (default min(cores, 2),
  at most 4). The kernel copies with ordinary stores; into a peer's
  :func:`kvxfer.shared_empty` pool (``shared=True``) the same threads copy
  themselves, with non-temporal stores from 32 MiB per batch (``STREAM_BYTES``).
- ``ucx:*`` and ``loopback``: the posting thread alone (UCX's cma is one
  ``process_vm_writev`` per block on the caller's thread; over TCP the socket
  limit applies instead).
- the agent's ``pack`` path: the C++ tile copy on :func:`kvxfer.kernels.num_threads`
  threads (those with >= 1 MiB each), non-temporal stores from 32 MiB per call.

The settings are those a measured agent gets, :meth:`kvxfer.AgentConfig.from_env`
(``KVXFER_VM_THREADS``, ``KVXFER_VM_SPLIT_BYTES``); what they resolve to (default,
cap) is asked of ``kvxfer._C`` at run time through :func:`kvxfer.transport.vm_copy_threads`
and :func:`kvxfer.transport.vm_copy_limits` (csrc/vm_copy.h), never copied here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyResources:
    """``threads`` copying at once and whether they use non-temporal stores."""

    threads: int
    streaming: bool = False

    def as_dict(self) -> dict:
        return {"threads": self.threads, "streaming": self.streaming}


def num_cores() -> int:
    return os.cpu_count() or 1  # what std::thread::hardware_concurrency reports


def vm_threads() -> int:
    """Copying threads of one split vm batch, the caller included."""
    from .. import AgentConfig
    from ..transport import vm_copy_threads

    return vm_copy_threads(AgentConfig.from_env().copy_threads, num_cores())


def vm_split_bytes() -> int:
    from .. import AgentConfig
    from ..transport import vm_copy_limits

    split = AgentConfig.from_env().vm_split_bytes
    return vm_copy_limits()["split_bytes"] if split is None else split


def transport_threads(transport: str, batch_bytes: int) -> int:
    """Threads that copy one posted batch of ``batch_bytes`` over ``transport``."""
    if transport == "vm":
        split = vm_split_bytes()
        return vm_threads() if split > 0 and batch_bytes >= split else 1
    return 1


def for_path(transport: str, nbytes: int, *, path: str = "zero_copy", senders: int = 1,
             receivers: int = 1, shared: bool = False) -> CopyResources:
    """Resources of moving ``nbytes`` in all: ``senders`` processes each posting one batch
    to each of ``receivers`` peers (the e2e bench's P and D tensor-parallel ranks);
    ``shared``: the peers' pools are :func:`kvxfer.shared_empty` memory."""
    from ..kernels import STREAM_BYTES

    if senders < 1 or receivers < 1:
        raise ValueError("senders and receivers must be >= 1")
    per_batch = nbytes // (senders * receivers)
    threads = transport_threads(transport, per_batch)
    streaming = shared and transport == "vm" and path == "zero_copy" and per_batch >= STREAM_BYTES
    if path == "pack":
        from ..kernels import num_threads

        threads = max(threads, min(num_threads(), max(1, per_batch >> 20)))
        streaming = per_batch >= STREAM_BYTES
    return CopyResources(threads * senders, streaming)
