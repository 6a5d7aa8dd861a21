"""Memory registry and descriptor validation, in one process (no peer needed:
an engine may connect to its own metadata, which exercises the same checks)."""
import os
import resource

import numpy as np
import pytest

from kvxfer.errors import InvalidDescriptor, ProtocolError
from kvxfer.transport import make_backend


@pytest.fixture
def backend():
    b = make_backend("auto")
    try:
        yield b
    finally:
        b.close()


def _buf(n, fill=0):
    return np.full(n, fill, np.uint8)


def test_register_and_covered_range_hits_cache(backend):
    x = _buf(1 << 16)
    r = backend.registry.register(x.ctypes.data, x.nbytes)
    assert (r.addr, r.length, r.device, r.is_cached) == (x.ctypes.data, x.nbytes, "cpu", False)
    sub = backend.registry.register(x.ctypes.data + 4096, 8192)
    assert sub.is_cached and sub.region_id != r.region_id
    # the covering region can go first: the mapping lives on with the sub-region
    backend.deregister(r.region_id)
    assert [q.region_id for q in backend.registry.regions()] == [sub.region_id]
    partial = backend.registry.register(x.ctypes.data + 60000, 8192)  # not covered
    assert not partial.is_cached


@pytest.mark.parametrize("addr_off,length,exc", [(0, 0, ValueError), (0, -1, ValueError)])
def test_register_rejects_bad_ranges(backend, addr_off, length, exc):
    x = _buf(64)
    with pytest.raises(exc):
        backend.register(x.ctypes.data + addr_off, length)


def test_register_rejects_bad_types_and_devices(backend):
    x = _buf(64)
    with pytest.raises(ValueError):
        backend.register(0, 64)
    with pytest.raises(TypeError):
        backend.register(float(x.ctypes.data), 64)
    with pytest.raises(TypeError):
        backend.register(x.ctypes.data, True)
    with pytest.raises(ValueError):
        backend.register(x.ctypes.data, 64, device="tpu")
    with pytest.raises(ValueError):
        backend.deregister(12345)


def test_register_tensor_span_of_a_strided_view(backend):
    torch = pytest.importorskip("torch")
    pool = torch.zeros(8, 2, 16, 4, dtype=torch.float16)
    view = pool[:, 1]  # non-contiguous: spans from pool[0,1] to the end of pool[7,1]
    r = backend.registry.register_tensor(view)
    assert r.addr == view.data_ptr()
    assert r.length == (7 * 2 * 16 * 4 + 16 * 4) * 2
    with pytest.raises(ValueError):
        backend.registry.register_tensor(torch.zeros(0))


def _mmap_prot_none(length):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, length, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value)
    return addr, lambda: libc.munmap(addr, length)


def test_unpinned_fallback_when_mlock_fails(backend):
    # mlock fails on PROT_NONE pages (ENOMEM) even for root: registered, reported unpinned
    addr, unmap = _mmap_prot_none(1 << 16)
    try:
        r = backend.registry.register(addr, 1 << 16)
        assert r.is_pinned is False
        backend.deregister(r)
    finally:
        unmap()
    x = _buf(1 << 16)
    assert backend.registry.register(x.ctypes.data, x.nbytes, pin=False).is_pinned is False


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores RLIMIT_MEMLOCK")
def test_unpinned_fallback_when_memlock_limit_is_exceeded(backend):
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
    try:
        x = _buf(1 << 20)
        assert backend.registry.register(x.ctypes.data, x.nbytes).is_pinned is False
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def _vm_lck_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def _rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_register_deregister_1000_cycles_is_flat(backend):
    x = _buf(256 * 1024, 1)
    for _ in range(100):  # warm up allocator pools
        backend.deregister(backend.register(x.ctypes.data, x.nbytes))
    rss0, lck0 = _rss_kib(), _vm_lck_kib()
    for i in range(1000):
        rid = backend.register(x.ctypes.data + (i % 7) * 64, x.nbytes - 512)
        backend.deregister(rid)
    assert len(backend.registry) == 0
    assert _vm_lck_kib() == lck0  # every mlock was undone
    assert _rss_kib() - rss0 < 1024


@pytest.fixture
def pair(backend):
    """Two local regions (src, dst) and a connection of the backend to itself."""
    src = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
    dst = _buf(1 << 16)
    rs = backend.register(src.ctypes.data, src.nbytes)
    rd = backend.register(dst.ctypes.data, dst.nbytes)
    conn = backend.connect(backend.metadata())
    return backend, conn, src, dst, rs, rd


@pytest.mark.parametrize(
    "rows,why",
    [
        ([[1, 0, 2, 0, 0]], "zero length"),
        ([[1, 0, 2, 0, -5]], "negative length"),
        ([[1, -1, 2, 0, 8]], "negative offset"),
        ([[1, 0, 2, 0, 4096], [1, 1024, 2, 8192, 4096]], "local range overlaps"),
        ([[1, 0, 2, 0, 4096], [1, 8192, 2, 2048, 4096]], "remote range overlaps"),
        ([[1, 0, 2, 0, 4096], [1, 8192, 2, (1 << 16) - 100, 200]], "remote range runs past"),
        ([[1, (1 << 16) - 1, 2, 0, 2]], "local range runs past"),
        ([[1, 0, 2, 2**63 - 8, 8]], "remote range runs past"),
        ([[1, 0, 2, 0, 2**63 - 1]], "runs past"),
        ([[1, 0, 99, 0, 8]], "remote region 99"),
        ([[77, 0, 2, 0, 8]], "local region 77"),
    ],
)
def test_invalid_batches_rejected_before_any_byte_moves(pair, rows, why):
    backend, conn, src, dst, rs, rd = pair
    rows = [[rs if r[0] == 1 else r[0], r[1], rd if r[2] == 2 else r[2], r[3], r[4]] for r in rows]
    with pytest.raises(InvalidDescriptor, match=why):
        backend.post(conn, "write", rows)
    assert not dst.any()  # the valid first rows were not written either


def test_descriptor_shape_and_dtype_errors(pair):
    backend, conn, *_ = pair
    with pytest.raises(ValueError):
        backend.post(conn, "write", np.zeros((3, 4), np.int64))
    with pytest.raises(TypeError):
        backend.post(conn, "write", np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError):
        backend.post(conn, "scatter", np.zeros((0, 5), np.int64))


def test_self_write_coalesced_and_deregistered_region_rejected(pair):
    backend, conn, src, dst, rs, rd = pair
    # 256 adjacent 64-byte rows coalesce into one range; result must be exact
    rows = np.array([[rs, 64 * i, rd, 1000 + 64 * i, 64] for i in range(256)], np.int64)
    backend.wait(backend.post(conn, "write", rows), timeout=10)
    assert np.array_equal(dst[1000 : 1000 + 256 * 64], src[: 256 * 64])
    assert backend.test(backend.post(conn, "write", np.zeros((0, 5), np.int64)))
    backend.deregister(rs)
    with pytest.raises(InvalidDescriptor, match="not registered"):
        backend.post(conn, "write", [[rs, 0, rd, 0, 8]])


def test_connect_rejects_garbage_metadata_with_typed_errors(backend):
    x = _buf(4096)
    backend.register(x.ctypes.data, x.nbytes)
    good = backend.metadata()
    rng = np.random.default_rng(0)
    cases = [b"", b"KVXM", b"\x00" * 64, good + b"\x00"]
    cases += [good[:n] for n in range(0, len(good), 7)]
    for _ in range(100):  # single-byte corruptions
        bad = bytearray(good)
        bad[int(rng.integers(len(bad)))] ^= int(rng.integers(1, 256))
        cases.append(bytes(bad))
    cases += [rng.integers(0, 256, int(rng.integers(1, 600)), dtype=np.uint8).tobytes() for _ in range(100)]
    for bad in cases:
        with pytest.raises(ProtocolError):
            backend.connect(bad)
    with pytest.raises(TypeError):
        backend.connect("not bytes")
    assert backend.connect(good).transport  # the engine is still healthy


@pytest.mark.parametrize("mode", ["advise", "collapse", "off"])
def test_huge_page_preference_keeps_contents(mode):
    # AgentConfig.hugepages asks for transparent huge pages at registration (collapse
    # rebuilds the pages already present); whether the kernel grants them varies, the
    # bytes must not.
    import mmap

    from kvxfer import AgentConfig
    size = 8 << 20
    buf = mmap.mmap(-1, size + (2 << 20))  # untouched anonymous memory, not 2 MiB aligned inside
    arr = np.frombuffer(buf, np.uint8)[4096 : 4096 + size]
    want = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    arr[: size // 2] = want[: size // 2]  # half touched before registration, half after
    b = make_backend("vm", config=AgentConfig(hugepages=mode))
    try:
        b.register(arr.ctypes.data, arr.nbytes)
        arr[size // 2 :] = want[size // 2 :]
        assert np.array_equal(arr, want)
    finally:
        b.close()
        del arr
        buf.close()
