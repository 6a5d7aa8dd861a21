"""The competitor's workload: NIXL's UCX backend, used the way vLLM's NixlConnector uses it.

Two spawned processes, each with one ``nixl_agent`` (UCX backend) and one
registered, page-aligned host pool. The initiator learns the target through
``get_agent_metadata``/``add_remote_agent``; for every block size it prepares
per-block descriptor lists for both pools once (``prep_xfer_dlist``, as vLLM does
at registration time), then each timed iteration is exactly vLLM's request path:
``make_prepped_xfer`` with the batch's block indices (prepare), ``transfer``
(post), ``check_xfer_state`` until ``DONE`` (transfer), ``release``.

Blocks are every other slot of the pool, so adjacent descriptors never merge
into one larger copy (real KV block ids are scattered). After each block size
the written slots are compared by CRC on both sides, so a silent no-op cannot
pass for a fast transfer.

Fair configuration (the same threads kvxfer's bench endpoints run):

- no NIXL progress thread (``enable_prog_thread=False``). NIXL's default one polls
  with no delay (``pthrDelay = 0``) and kept both cores of a 2-core host busy
  while idle; kvxfer has no such thread. The initiator drives UCX from its own
  thread through ``check_xfer_state``, as kvxfer's initiator polls ``Backend.test``.
  The target progresses UCX (``get_new_notifs``) between naps of at most
  ``TARGET_NAP_S`` (0.05 ms): NIXL's API has no event fd to sleep on, while
  kvxfer's target endpoint sleeps on the UCX worker's event fd and wakes when a
  message arrives; a short nap answers about as fast without spinning a core.
- ``threads``: NIXL's UCX backend ``num_threads`` option, set by the caller to the
  copy threads kvxfer's path uses (:mod:`kvxfer.bench.resources`); 0 keeps
  NIXL's default. With ``threads`` > 0 NIXL's UCX backend runs a thread pool: one
  UCX worker (its own TCP connection to the peer) and one thread per ``threads``,
  and it splits a transfer of at least ``split_batch`` descriptors (its
  ``split_batch_size`` option; None: NIXL's default of 1024, 4096 with SGL) into
  ``threads`` contiguous chunks of descriptors, one per worker: NIXL's own striping
  of one request over several connections (``kvxfer bench transfer --nixl-threads N
  --nixl-split-batch 1``; docs/benchmarks.md).

Across hosts (``kvxfer bench transfer --listen/--connect --compare nixl``) the
target runs under :func:`listen` on the other host (the kvxfer port + 1) and
:class:`NixlSession` ``(connect=...)`` spawns only the initiator; both sides
take UCX's transports from the environment (``UCX_TLS=tcp`` in
``benchmarks/tcp_netns.sh``).
"""
from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import time
import zlib

from ..errors import KVXferError, PeerDisconnected, TransferTimeout

_MODULES = ("nixl._api", "nixl_cu12._api")


def available() -> str | None:
    """The importable NIXL API module name, or None (``nixl`` or ``nixl-cu12`` wheel)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines would bury the table
    for name in _MODULES:
        try:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            importlib.import_module(name)
            return name
        except Exception:  # a broken install is 'not available', said by the caller
            continue
    return None


def _api():
    name = available()
    if name is None:
        raise KVXferError("NIXL is not importable (pip install --no-deps nixl-cu12)")
    return importlib.import_module(name)


TARGET_NAP_S = 0.00005


def _slot_offsets(block_size: int, batch: int):
    return [2 * i * block_size for i in range(batch)]


class _Pool:
    def __init__(self, nbytes: int):
        from .copy_limit import page_aligned

        self.buf = page_aligned(nbytes)
        self.addr = int(self.buf.ctypes.data)
        self.nbytes = nbytes

    def fill(self, seed: int) -> None:
        import numpy as np

        self.buf[:] = np.random.default_rng(seed).integers(0, 256, self.nbytes, dtype=np.uint8)

    def crc(self, block_size: int, batch: int) -> int:
        crc = 0
        for off in _slot_offsets(block_size, batch):
            crc = zlib.crc32(self.buf[off:off + block_size].data, crc)
        return crc


def _make_agent(name: str, pool: _Pool, threads: int, split_batch: int | None = None):
    api = _api()
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=threads)
    agent = api.nixl_agent(name, config)
    params = {"num_threads": str(threads)} if threads > 0 else {}
    if split_batch is not None:
        params["split_batch_size"] = str(split_batch)
    agent.create_backend("UCX", params)
    if "UCX" not in agent.backends:
        raise KVXferError("NIXL has no UCX backend plugin")
    agent.register_memory([(pool.addr, pool.nbytes, 0, "kv")], "DRAM")
    return agent


def listen(address: str, authkey: bytes, timeout: float | None = None) -> None:
    """Serve one NIXL target for a :class:`NixlSession` ``(connect=address)`` elsewhere."""
    from .endpoint import accept_session

    conn, (pool_bytes, threads, split_batch) = accept_session(address, authkey, timeout)
    _target_main(conn, pool_bytes, threads, split_batch)


def _target_main(conn, pool_bytes: int, threads: int, split_batch: int | None = None) -> None:
    """Target process: own a pool, publish metadata, answer fill/crc requests; between
    requests progress UCX every ``TARGET_NAP_S``."""
    try:
        pool = _Pool(pool_bytes)
        agent = _make_agent("kvxfer-bench-nixl-target", pool, threads, split_batch)
        conn.send(("ready", agent.get_agent_metadata(), pool.addr))
        while True:
            while not conn.poll(TARGET_NAP_S):
                agent.get_new_notifs()  # progresses the UCX worker (emulated RMA needs it)
            cmd, *rest = conn.recv()
            if cmd == "stop":
                return
            if cmd == "fill":
                pool.fill(rest[0])
                conn.send(("ok",))
            elif cmd == "crc":
                conn.send(("ok", pool.crc(*rest)))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _initiator_main(conn, pool_bytes: int, timeout: float, threads: int, split_batch: int | None = None) -> None:
    """Initiator process: run timed iterations on request, return the samples."""
    import numpy as np

    try:
        pool = _Pool(pool_bytes)
        agent = _make_agent("kvxfer-bench-nixl-initiator", pool, threads, split_batch)
        conn.send(("ready",))
        remote_name, remote_addr = None, 0
        while True:
            cmd, *rest = conn.recv()
            if cmd == "stop":
                return
            if cmd == "peer":
                remote_name = agent.add_remote_agent(rest[0])
                remote_addr = rest[1]
                conn.send(("ok", remote_name))
            elif cmd == "fill":
                pool.fill(rest[0])
                conn.send(("ok",))
            elif cmd == "crc":
                conn.send(("ok", pool.crc(*rest)))
            elif cmd == "measure":
                block_size, batch, op, iters, warmup = rest
                num_slots = pool_bytes // block_size
                local = [(pool.addr + i * block_size, block_size, 0) for i in range(num_slots)]
                remote = [(remote_addr + i * block_size, block_size, 0) for i in range(num_slots)]
                local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
                remote_h = agent.prep_xfer_dlist(remote_name, remote, "DRAM")
                idx = np.arange(0, 2 * batch, 2, dtype=np.int32)
                samples = {"prepare_s": [], "post_s": [], "transfer_s": [], "latency_s": []}
                try:
                    for i in range(warmup + iters):
                        t0 = time.perf_counter()
                        h = agent.make_prepped_xfer(op.upper(), local_h, idx, remote_h, idx)
                        t1 = time.perf_counter()
                        state = agent.transfer(h)
                        t2 = time.perf_counter()
                        deadline = t2 + timeout
                        while state == "PROC":
                            if time.perf_counter() > deadline:
                                raise TransferTimeout(f"NIXL transfer not done within {timeout}s")
                            state = agent.check_xfer_state(h)
                        t3 = time.perf_counter()
                        agent.release_xfer_handle(h)
                        if state != "DONE":
                            raise KVXferError(f"NIXL transfer failed: state {state}")
                        if i >= warmup:
                            samples["prepare_s"].append(t1 - t0)
                            samples["post_s"].append(t2 - t1)
                            samples["transfer_s"].append(t3 - t1)
                            samples["latency_s"].append(t3 - t0)
                finally:
                    agent.release_dlist_handle(local_h)
                    agent.release_dlist_handle(remote_h)
                conn.send(("ok", samples))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class NixlSession:
    """A NIXL initiator/target pair kept alive for a sweep (context manager).

    ``measure(block_size, batch, op, iters, warmup)`` returns per-iteration samples
    (seconds) of prepare, post, transfer and latency, warm-up dropped, after
    checking that the batch's bytes arrived. ``threads``: see the module doc.
    """

    transport = "nixl:UCX"

    def __init__(self, pool_bytes: int, *, timeout: float = 60.0, threads: int = 0,
                 split_batch: int | None = None, connect: str | None = None, authkey: bytes = b""):
        self.pool_bytes = pool_bytes
        self.timeout = timeout
        self.threads = int(threads)
        self.split_batch = None if split_batch is None else int(split_batch)
        self.connect, self.authkey = connect, authkey  # target under listen() at this address
        self._procs: list = []
        self._init = self._target = None

    def _call(self, conn, *msg):
        if msg:
            conn.send(msg)
        if not conn.poll(self.timeout):
            raise TransferTimeout(f"NIXL bench process did not answer {msg[:1]} within {self.timeout}s")
        try:
            reply = conn.recv()
        except EOFError as exc:
            raise PeerDisconnected("NIXL bench process exited") from exc
        if reply[0] == "error":
            raise KVXferError(f"NIXL bench process failed: {reply[1]}")
        return reply

    def __enter__(self) -> "NixlSession":
        _api()  # fail here, in the parent, with a clear message
        ctx = mp.get_context("spawn")
        self._init, i_child = ctx.Pipe()
        self._procs = [ctx.Process(target=_initiator_main, daemon=True,
                                   args=(i_child, self.pool_bytes, self.timeout, self.threads,
                                         self.split_batch))]
        if self.connect:
            from multiprocessing.connection import Client

            host, port = self.connect.rsplit(":", 1)
            self._target = Client((host, int(port)), authkey=self.authkey)
            self._target.send((self.pool_bytes, self.threads, self.split_batch))
        else:
            self._target, t_child = ctx.Pipe()
            self._procs.append(ctx.Process(target=_target_main, daemon=True,
                                           args=(t_child, self.pool_bytes, self.threads, self.split_batch)))
        for p in self._procs:
            p.start()
        try:
            _, metadata, addr = self._call(self._target)
            self._call(self._init)
            self._call(self._init, "peer", metadata, addr)
        except BaseException:
            self.close()
            raise
        return self

    def measure(self, block_size: int, batch: int, op: str, iters: int, warmup: int) -> dict:
        if 2 * batch * block_size > self.pool_bytes:
            raise ValueError("batch of blocks does not fit the NIXL pool")
        seed = block_size * 1009 + batch
        self._call(self._init, "fill", seed)
        self._call(self._target, "fill", seed + 1)
        _, samples = self._call(self._init, "measure", block_size, batch, op, iters, warmup)
        _, mine = self._call(self._init, "crc", block_size, batch)
        _, theirs = self._call(self._target, "crc", block_size, batch)
        if mine != theirs:
            raise KVXferError(f"NIXL {op} of {batch}x{block_size} B: data mismatch after transfer")
        return samples

    def close(self) -> None:
        for conn in (self._init, self._target):
            if conn is not None:
                try:
                    conn.send(("stop",))
                except (OSError, BrokenPipeError):
                    pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._init = self._target = None

    def __exit__(self, *exc) -> None:
        self.close()
