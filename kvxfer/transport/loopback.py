"""``loopback``: an in-process backend for unit tests.

Agents in one process reach each other's regions through a process-wide table;
``post`` copies with ``memmove`` before it returns, so completion is immediate
and the data is visible when :meth:`test` first returns True. Descriptors are
validated against the *live* regions of both sides, so a deregistered region
fails with :class:`~kvxfer.errors.InvalidDescriptor` like a real backend's key.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import os
import threading
import uuid
import weakref

import numpy as np

from ..errors import InvalidDescriptor, KVXferError, PeerDisconnected, ProtocolError, TransferTimeout
from .base import Backend, Capabilities, Connection

_FABRIC: "weakref.WeakValueDictionary[str, LoopbackBackend]" = weakref.WeakValueDictionary()


class LoopbackBackend(Backend):
    def __init__(self) -> None:
        self.uid = uuid.uuid4().hex
        self._regions: dict[int, tuple[int, int]] = {}
        self._ids = itertools.count(1)
        self._reqs = itertools.count(1)
        self._done: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        _FABRIC[self.uid] = self

    def capabilities(self) -> Capabilities:
        return Capabilities("loopback", per_desc_overhead_us=0.3)

    def register(self, addr: int, length: int, *, device: str = "cpu", device_id: int = 0) -> int:
        if device != "cpu":
            raise KVXferError("the loopback backend moves host memory only")
        if addr <= 0 or length <= 0:
            raise ValueError(f"cannot register [{addr:#x}, +{length})")
        with self._lock:
            rid = next(self._ids)
            self._regions[rid] = (addr, length)
            return rid

    def deregister(self, region_id: int) -> None:
        with self._lock:
            self._regions.pop(region_id, None)

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    def metadata(self) -> bytes:
        return json.dumps({"uid": self.uid, "pid": os.getpid()}).encode()

    def connect(self, peer_metadata: bytes) -> Connection:
        try:
            md = json.loads(peer_metadata)
            uid, pid = md["uid"], md["pid"]
        except (ValueError, KeyError, TypeError):
            raise ProtocolError("invalid loopback metadata") from None
        if pid != os.getpid():
            raise KVXferError("the loopback backend only connects agents of one process")
        peer = _FABRIC.get(uid)
        if peer is None:
            raise PeerDisconnected("loopback peer is gone")
        conn = Connection(peer_id=id(peer), transport="loopback")
        conn.remote_regions = peer  # type: ignore[assignment] - live view, see _check
        return conn

    def disconnect(self, conn: Connection) -> None:
        conn.remote_regions = {}

    @staticmethod
    def _check(regions: dict, rid: int, off: int, n: int, side: str) -> int:
        span = regions.get(int(rid))
        if span is None or off < 0 or n < 0 or off + n > span[1]:
            raise InvalidDescriptor(f"{side} region {rid} [{off}, +{n}) is not registered")
        return int(span[0] + off)  # numpy ints are not ctypes pointers

    def post(self, conn: Connection, op: str, descs) -> int:
        if op not in ("write", "read"):
            raise ValueError(f"op must be 'write' or 'read', got {op!r}")
        peer = conn.remote_regions
        if not isinstance(peer, LoopbackBackend) or peer._closed:
            raise PeerDisconnected("loopback peer is gone")
        d = np.asarray(descs, dtype=np.int64).reshape(-1, 5)
        with self._lock, peer._lock:
            pairs = [(self._check(self._regions, r[0], r[1], r[4], "local"),
                      self._check(peer._regions, r[2], r[3], r[4], "remote"), int(r[4])) for r in d]
        for local, remote, n in pairs:
            if op == "write":
                ctypes.memmove(remote, local, n)
            else:
                ctypes.memmove(local, remote, n)
        with self._lock:
            req = next(self._reqs)
            self._done.add(req)
            return req

    def test(self, request_id: int) -> bool:
        with self._lock:
            if request_id in self._done:
                self._done.discard(request_id)
                return True
        raise KVXferError(f"unknown request {request_id}")

    def wait(self, request_id: int, timeout: float) -> None:
        if not self.test(request_id):
            raise TransferTimeout(f"request {request_id} not complete after {timeout} s")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._regions.clear()
            self._done.clear()
        _FABRIC.pop(self.uid, None)
