"""UcxBackend between real processes (multiprocessing spawn, one host).

Modes: ``vm`` (process_vm_writev fast path), ``vm-shared`` (the same path into a
peer pool of :func:`kvxfer.shared_empty` memory: mapped, memcpy), ``ucx`` (UCX
forced, its default same-host transports) and ``tcp`` (UCX_TLS=tcp in both processes).
"""
import contextlib
import os

import numpy as np
import pytest

from kvxfer.errors import InvalidDescriptor, PeerDisconnected
from kvxfer.transport import make_backend

import transport_peer

POOL = 1 << 20
BLOCK = 4096
MODES = ["vm", "vm-shared", "ucx", "tcp"]


def _env(mode):
    return {"UCX_TLS": "tcp"} if mode == "tcp" else {}


def peer(mode, pool_bytes=POOL):
    return transport_peer.spawned(pool_bytes, _env(mode), shared=mode == "vm-shared")


_ask = transport_peer.ask


@contextlib.contextmanager
def initiator(mode, config=None):
    saved = os.environ.get("UCX_TLS")
    os.environ.update(_env(mode))  # UCX reads its config when the engine is created
    try:
        b = make_backend("vm" if mode.startswith("vm") else "ucx", config=config)
    finally:
        if mode == "tcp":
            os.environ.pop("UCX_TLS") if saved is None else os.environ.__setitem__("UCX_TLS", saved)
    try:
        yield b
    finally:
        b.close()


def _check_transport(mode, conn):
    if mode.startswith("vm"):
        assert conn.transport == "vm" and conn.shared_regions == (mode == "vm-shared")
    elif mode == "tcp":
        assert conn.transport.startswith("ucx:tcp")
    else:
        assert conn.transport.startswith("ucx:") and "tcp" not in conn.transport


@pytest.mark.parametrize("mode", MODES)
def test_scattered_write_then_read_back(mode):
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 64 * BLOCK, dtype=np.uint8)
    slots = rng.permutation(POOL // BLOCK)[:64]
    with peer(mode) as (_, pipe, meta, rid), initiator(mode) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        _check_transport(mode, conn)
        rows = np.array([[ls, i * BLOCK, rid, s * BLOCK, BLOCK] for i, s in enumerate(slots)], np.int64)
        b.wait(b.post(conn, "write", rows), timeout=30)
        pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        expect = np.zeros(POOL, np.uint8)
        for i, s in enumerate(slots):
            expect[s * BLOCK : (s + 1) * BLOCK] = src[i * BLOCK : (i + 1) * BLOCK]
        assert np.array_equal(pool, expect)

        dst = np.zeros_like(src)
        ld = b.register(dst.ctypes.data, dst.nbytes)
        rows[:, 0] = ld
        b.wait(b.post(conn, "read", rows[::-1].copy()), timeout=30)
        assert np.array_equal(dst, src)
        b.disconnect(conn)
        b.disconnect(conn)  # idempotent


@pytest.mark.parametrize("mode", MODES)
def test_many_small_descriptors(mode):
    n = 8192  # 64-byte runs at a 96-byte stride: nothing coalesces
    src = np.random.default_rng(2).integers(0, 256, n * 64, dtype=np.uint8)
    with peer(mode) as (_, pipe, meta, rid), initiator(mode) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        i = np.arange(n, dtype=np.int64)
        rows = np.stack([np.full(n, ls), i * 64, np.full(n, rid), i * 96, np.full(n, 64)], axis=1)
        b.wait(b.post(conn, "write", rows), timeout=60)
        pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        got = pool[: n * 96].reshape(n, 96)[:, :64].reshape(-1)
        assert np.array_equal(got, src)
        assert not pool[: n * 96].reshape(n, 96)[:, 64:].any()


@pytest.mark.parametrize("mode", MODES)
def test_mixed_run_sizes_small_batched_large_put(mode):
    # Over tcp, runs <= 64 KiB travel as batched active messages and larger ones
    # as puts, in one request; every byte must land either way.
    sizes = [1, 4096, 70_000, 64 * 1024, 3, 200_000, 8192]
    offs = np.cumsum([0] + sizes)
    src = np.random.default_rng(5).integers(1, 256, int(offs[-1]), dtype=np.uint8)
    with peer(mode) as (_, pipe, meta, rid), initiator(mode) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        gap = 1000  # remote ranges apart: nothing coalesces
        rows = np.array([[ls, offs[k], rid, offs[k] + gap * k, n] for k, n in enumerate(sizes)], np.int64)
        b.wait(b.post(conn, "write", rows), timeout=30)
        pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        for k, n in enumerate(sizes):
            assert np.array_equal(pool[offs[k] + gap * k : offs[k] + gap * k + n], src[offs[k] : offs[k] + n])
        assert int(np.count_nonzero(pool)) == int(offs[-1])


def test_tcp_batched_write_to_a_deregistered_region_is_refused_by_the_target():
    src = np.full(2 * BLOCK, 9, np.uint8)
    with peer("tcp") as (_, pipe, meta, rid), initiator("tcp") as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        stale = b.connect(meta)
        _ask(pipe, "deregister")  # our connection still lists the region; the target does not
        with pytest.raises(InvalidDescriptor, match="refused"):
            b.wait(b.post(stale, "write", [[ls, 0, rid, 0, BLOCK], [ls, BLOCK, rid, 4 * BLOCK, BLOCK]]), timeout=30)
        assert not np.frombuffer(_ask(pipe, "bytes"), np.uint8).any()


@pytest.mark.parametrize("mode", ["vm", "vm-shared", "ucx"])
def test_remote_bounds_and_deregistration_enforced(mode):
    src = np.full(3 * BLOCK, 7, np.uint8)
    with peer(mode) as (_, pipe, meta, rid), initiator(mode) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        rows = [[ls, 0, rid, 0, BLOCK], [ls, BLOCK, rid, BLOCK, BLOCK], [ls, 2 * BLOCK, rid, POOL - 10, BLOCK]]
        with pytest.raises(InvalidDescriptor, match="past"):
            b.post(conn, "write", rows)
        assert not np.frombuffer(_ask(pipe, "bytes"), np.uint8).any()  # nothing was written
        fresh = b.connect(_ask(pipe, "deregister"))  # the peer's new metadata lacks the region
        with pytest.raises(InvalidDescriptor, match="not advertised"):
            b.post(fresh, "write", rows[:1])


@pytest.mark.parametrize("mode", MODES)
def test_peer_killed_mid_batch_then_survivor_moves_on(mode):
    size = 8 << 20
    src = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    with initiator(mode) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        n = size // BLOCK
        i = np.arange(n, dtype=np.int64)[::-1].copy()  # reversed: no coalescing
        with peer(mode, size) as (proc, pipe, meta, rid):
            conn = b.connect(meta)
            _check_transport(mode, conn)
            rows = np.stack([np.full(n, ls), i * BLOCK, np.full(n, rid), i[::-1] * BLOCK, np.full(n, BLOCK)], axis=1)
            transport_peer.write_until_killed(b, conn, rows, proc, after_s=0.3)
            with pytest.raises(PeerDisconnected):
                b.post(conn, "write", rows[:1])
            b.disconnect(conn)
        # the survivor registers again and transfers to a new peer
        extra = np.arange(BLOCK, dtype=np.uint8)
        le = b.register(extra.ctypes.data, extra.nbytes)
        with peer(mode) as (_, pipe, meta, rid):
            conn = b.connect(meta)
            b.wait(b.post(conn, "write", [[le, 0, rid, BLOCK, BLOCK]]), timeout=30)
            pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
            assert np.array_equal(pool[BLOCK : 2 * BLOCK], extra)


@pytest.mark.parametrize("mode", ["vm", "vm-shared"])
@pytest.mark.parametrize("split", ["8192", "0"])
def test_vm_batch_split_across_copy_threads(split, mode):
    # vm_split_bytes=8192 makes even this small batch split across the copy threads,
    # cutting runs mid-way at page boundaries; odd lengths and scattered, reversed
    # remote slots must still land byte for byte, both directions.
    from kvxfer import AgentConfig

    config = AgentConfig(vm_split_bytes=int(split))
    rng = np.random.default_rng(4)
    run, stride = 5000, 3 * BLOCK
    n = POOL // stride
    src = rng.integers(0, 256, n * run, dtype=np.uint8)
    slots = rng.permutation(n)
    with peer(mode) as (_, pipe, meta, rid), initiator(mode, config) as b:
        ls = b.register(src.ctypes.data, src.nbytes)
        conn = b.connect(meta)
        _check_transport(mode, conn)
        rows = np.array([[ls, i * run, rid, s * stride + 7, run] for i, s in enumerate(slots)], np.int64)
        b.wait(b.post(conn, "write", rows), timeout=30)
        pool = np.frombuffer(_ask(pipe, "bytes"), np.uint8)
        expect = np.zeros(POOL, np.uint8)
        for i, s in enumerate(slots):
            expect[s * stride + 7 : s * stride + 7 + run] = src[i * run : (i + 1) * run]
        assert np.array_equal(pool, expect)

        dst = np.zeros_like(src)
        rows[:, 0] = b.register(dst.ctypes.data, dst.nbytes)
        b.wait(b.post(conn, "read", rows), timeout=30)
        assert np.array_equal(dst, src)


def test_copy_threads_is_one_value_per_process():
    # The same-host copy pool is the process's: the first backend that sets copy_threads
    # fixes it, a different setting later is a ValueError (nothing built), none given
    # accepts it; the split size is each backend's own.
    import subprocess
    import sys

    code = """
import pytest
from kvxfer import AgentConfig, _native
from kvxfer.transport import make_backend
C = _native.load()
a = make_backend("ucx", config=AgentConfig(copy_threads=1, vm_split_bytes=0))
with pytest.raises(ValueError, match="copy_threads=3"):
    make_backend("ucx", config=AgentConfig(copy_threads=3))
b = make_backend("ucx", config=AgentConfig(vm_split_bytes=8192))
c = make_backend("ucx", config=AgentConfig(copy_threads=1))
assert C.vm_copy_threads() == 1
assert C.vm_resolve_threads(9, 8) == 4 and C.vm_resolve_threads(0, 8) == 2 and C.vm_resolve_threads(0, 1) == 1
for x in (a, b, c):
    x.close()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_copy_pool_helpers_are_kept_off_the_callers_cpu():
    # A job steers the pool's helpers ("kvxfer-copy") off the CPU its caller runs on, while
    # the caller may run on others: a helper woken onto the caller's CPU would queue behind
    # it. A warmed pool still runs every job whole.
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    code = f"""
import os, numpy as np
from kvxfer import _native
C = _native.load()
os.sched_setaffinity(0, {cpus[:2]!r})
src = np.arange(8 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
C.warm_copy_pool(2000)
sums = C.copy_checksum_objects(src.ctypes.data + np.array([0, 4 << 20]), dst.ctypes.data + np.array([0, 4 << 20]),
                               np.array([4 << 20, 4 << 20]), [1, 1], False, 1)
assert np.array_equal(src, dst) and len(sums) == 2 and C.vm_copy_threads() == 2
helpers = []
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{{tid}}/comm") as f:
        if f.read().strip() == "kvxfer-copy":
            helpers.append(os.sched_getaffinity(int(tid)))
assert len(helpers) == 1, helpers
assert len(helpers[0]) == 1 and helpers[0] < set({cpus[:2]!r}), helpers
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_every_backend_is_a_context_manager():
    # Backend (the base class) closes a backend on leaving a with block, whichever it is
    from kvxfer.errors import KVXferError

    buf = np.zeros(BLOCK, np.uint8)
    with make_backend("ucx") as b:
        b.register(buf.ctypes.data, BLOCK)
    with pytest.raises(KVXferError):
        b.register(buf.ctypes.data, BLOCK)
    with make_backend("loopback") as src, make_backend("loopback") as dst:
        rs, rd = src.register(buf.ctypes.data, BLOCK), dst.register(buf.ctypes.data, BLOCK)
        conn = src.connect(dst.metadata())
    with pytest.raises(PeerDisconnected):  # dst left its with block closed
        src.post(conn, "write", [[rs, 0, rd, 0, BLOCK]])
