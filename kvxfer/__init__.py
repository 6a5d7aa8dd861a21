"""kvxfer: paged KV-cache transfer for disaggregated prefill/decode serving.

Pipeline (one stage a module or package): describe (:mod:`kvxfer.layout`) ->
pack/unpack (:mod:`kvxfer.kernels`) -> register (:mod:`kvxfer.memory`, ``kvxfer._C``) ->
move (:mod:`kvxfer.transport`) -> agent API (:mod:`kvxfer.agent`, admitted through
:mod:`kvxfer.auth`, sockets from :mod:`kvxfer.net`) -> the KV pool
(:mod:`kvxfer.store`) -> the reference serving stack (:mod:`kvxfer.serving`, its
simulated engine in :mod:`kvxfer.serving.simulated`), engine integrations
(:mod:`kvxfer.integrations`), the planner (:mod:`kvxfer.sim`) and the ``kvxfer`` CLI.

Heavy dependencies (torch, triton, UCX) are imported lazily: ``import kvxfer``
alone loads only the error hierarchy.
"""
from __future__ import annotations

import importlib

from . import errors
from .errors import (
    AuthenticationError,
    BlocksBusy,
    ConnectionRefused,
    InvalidDescriptor,
    KVXferError,
    LayoutMismatch,
    LimitExceeded,
    PeerDisconnected,
    ProtocolError,
    RegistrationError,
    StoreMiss,
    StorePartConflict,
    TransferCancelled,
    TransferTimeout,
)

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "KVLayout": "kvxfer.layout",
    "pack": "kvxfer.kernels",
    "unpack": "kvxfer.kernels",
    "Agent": "kvxfer.agent",
    "Peer": "kvxfer.agent",
    "AgentConfig": "kvxfer.config",
    "PeerLimits": "kvxfer.config",
    "CostModel": "kvxfer.transport.paths",
    "TransferHandle": "kvxfer.handle",
    "HandleState": "kvxfer.handle",
    "shared_empty": "kvxfer.shared_memory",
    "KVStore": "kvxfer.store",
    "block_keys": "kvxfer.store",
}

__all__ = [*errors.__all__, *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
