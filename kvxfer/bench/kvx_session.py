"""kvxfer's workload for ``kvxfer bench transfer``: a pair of endpoints kept for a sweep.

:class:`KvxSession` mirrors :class:`kvxfer.bench.nixl.NixlSession` (same
``measure`` signature and sample names), so the CLI can interleave the two
(A B A B). The endpoints and what each path times are described in
:mod:`kvxfer.bench.endpoint`.
"""
from __future__ import annotations

import multiprocessing as mp

from ..errors import KVXferError
from .endpoint import IN_PROCESS_BACKENDS, LocalEndpoint, RemoteEndpoint, SpawnedEndpoint

PATHS = ("zero-copy", "pack")


class KvxSession:
    """Initiator + target endpoints over backend ``backend`` (context manager)."""

    def __init__(self, backend: str, *, slot_bytes: int, batch: int, timeout: float = 60.0,
                 connect: str | None = None, authkey: bytes = b""):
        self.backend = backend
        self.connect_to, self.authkey = connect, authkey
        self.slot_bytes, self.batch, self.timeout = slot_bytes, batch, timeout
        self.init = self.target = None
        self.transport = "?"

    def __enter__(self) -> "KvxSession":
        try:
            if self.connect_to:  # target on another host (``--listen`` there)
                self.target = RemoteEndpoint(self.connect_to, self.backend, self.slot_bytes, self.batch,
                                      self.timeout, self.authkey)
                self.init = SpawnedEndpoint(mp.get_context("spawn"), self.backend, self.slot_bytes,
                                     self.batch, self.timeout)
            elif self.backend in IN_PROCESS_BACKENDS:
                self.target = LocalEndpoint(self.backend, self.slot_bytes, self.batch)
                self.init = LocalEndpoint(self.backend, self.slot_bytes, self.batch)
            else:
                ctx = mp.get_context("spawn")
                self.target = SpawnedEndpoint(ctx, self.backend, self.slot_bytes, self.batch, self.timeout)
                self.init = SpawnedEndpoint(ctx, self.backend, self.slot_bytes, self.batch, self.timeout)
            self.transport = self.init.call("connect", *self.target.call("hello"))
        except BaseException:
            self.close()
            raise
        return self

    def measure(self, block_size: int, batch: int, op: str, iters: int, warmup: int,
                *, path: str = "zero-copy", check: bool = False) -> dict:
        """Per-iteration samples in seconds (warm-up dropped): prepare, post, transfer,
        unpack, latency; ``path`` is the one used. Raises :class:`KVXferError` on wrong bytes."""
        if op not in ("write", "read"):
            raise ValueError("op must be 'write' or 'read'")
        if block_size > self.slot_bytes or batch > self.batch:
            raise ValueError("block size / batch exceed the session's pool")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}")
        src, dst = (self.init, self.target) if op == "write" else (self.target, self.init)
        names = ("prepare_s", "post_s", "transfer_s", "unpack_s", "latency_s")
        samples: dict = {k: [] for k in names}
        seed0 = block_size * 7919 + batch * 31
        src.call("fill", seed0, block_size, batch)
        for i in range(warmup + iters):
            if check:
                seed = seed0 + 1 + i
                src.call("fill", seed, block_size, batch)
                dst.call("fill", seed + 1_000_003, block_size, batch)  # stale bytes must not pass
            if path == "zero-copy":
                s = self.init.call("zero_copy", block_size, batch, op, self.timeout)
                s["unpack_s"] = 0.0
            else:
                prepare = src.call("gather", block_size, batch)
                s = self.init.call("staged", block_size * batch, op, self.timeout)
                s["prepare_s"] = prepare
                s["unpack_s"] = dst.call("scatter", block_size, batch)
            s["latency_s"] = s["prepare_s"] + s["transfer_s"] + s["unpack_s"]
            if check:
                bad = dst.call("verify", seed, block_size, batch)
                if bad is not None:
                    raise KVXferError(f"--check: {op} of {batch}x{block_size} B via {path}, "
                                      f"iteration {i}: byte {bad} differs")
            if i >= warmup:
                for k in names:
                    samples[k].append(s[k])
        samples["path"] = path
        return samples

    def close(self) -> None:
        for side in (self.init, self.target):
            if side is not None:
                side.close()
        self.init = self.target = None

    def __exit__(self, *exc) -> None:
        self.close()
