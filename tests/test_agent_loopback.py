"""Agent end to end in one process over the loopback backend: every path and
layout pair bitwise, either side first, concurrency, TP, streaming, one-sided
ops, cancel/timeout/leases, metrics, and no leaks over many requests."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer import Agent, AgentConfig
from kvxfer.errors import KVXferError, TransferCancelled, TransferTimeout

from agent_procs import SECRET, make_pool
from kvxfer.transport.loopback import LoopbackBackend

T = 20.0  # generous wait limit; nothing here should take more than a fraction of it


def pair(p_dims="2 N B H D", d_dims="2 N B H D", *, path="auto", dtype="float16", p_tp=(0, 1),
         d_tp=(0, 1), lease_timeout=30.0, **kw):
    p_layout = make_pool(p_dims, 1, dtype=dtype, tp_rank=p_tp[0], tp_size=p_tp[1])
    d_layout = make_pool(d_dims, None, dtype=dtype, tp_rank=d_tp[0], tp_size=d_tp[1])
    cfg = AgentConfig(path=path, lease_timeout=lease_timeout)
    p = Agent("p", secret=SECRET, backend="loopback", config=cfg, **kw)
    d = Agent("d", secret=SECRET, backend="loopback", config=cfg, **kw)
    p.register_kv(p_layout)
    d.register_kv(d_layout)
    return p, d, p_layout, d_layout, p.connect(d.address)


def same(src_layout, src_ids, dst_layout, dst_ids, heads=None) -> bool:
    return torch.equal(kvxfer.pack(src_layout, src_ids, heads=heads, backend="reference"),
                       kvxfer.pack(dst_layout, dst_ids, heads=heads, backend="reference"))





@pytest.mark.parametrize("path", ["zero_copy", "pack", "auto"])
@pytest.mark.parametrize("p_dims,d_dims", [("2 N B H D", "2 N B H D"), ("2 N B H D", "N 2 H B D"),
                                           ("N 2 H B D", "N 2 H B D"), ("N 2 H B D", "2 N B H D")])
def test_bitwise_across_layouts_and_paths(path, p_dims, d_dims):
    p, d, pl, dl, peer = pair(p_dims, d_dims, path=path)
    try:
        src, dst = [9, 3, 31, 0, 4], [2, 30, 7, 11, 5]
        hr = d.recv("r", dst, timeout=T)
        hs = p.send(peer, "r", src)
        hs.wait(T)
        hr.wait(T)
        assert same(pl, src, dl, dst)
        assert hs.path == hr.path == (path if path != "auto" else hs.path)
        assert untouched_elsewhere(dl, dst)
    finally:
        p.close()
        d.close()


def untouched_elsewhere(layout, ids) -> bool:
    others = [b for b in range(layout.num_blocks) if b not in ids]
    return not kvxfer.pack(layout, others, backend="reference").any()


@pytest.mark.parametrize("p_dims,d_dims", [("N L 2 B H D", "2 N B H D"), ("2 N H B D", "L N 2 B H D"),
                                           ("N B C", "N B C")])
def test_cross_layer_and_mla_pools(p_dims, d_dims):
    p, d, pl, dl, peer = pair(p_dims, d_dims)
    try:
        hr = d.recv("x", [4, 0, 17], timeout=T)
        p.send(peer, "x", [30, 2, 5]).wait(T)
        hr.wait(T)
        assert same(pl, [30, 2, 5], dl, [4, 0, 17]) and untouched_elsewhere(dl, [4, 0, 17])
    finally:
        p.close()
        d.close()


_AGENTS: dict = {}


@pytest.fixture(scope="module")
def agent_pairs():
    yield _AGENTS
    for p, d, *_ in _AGENTS.values():
        p.close()
        d.close()
    _AGENTS.clear()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_block_ids_bitwise(agent_pairs, data):
    key = data.draw(st.sampled_from([("2 N B H D", "N 2 H B D", "auto"), ("N 2 H B D", "2 N B H D", "pack"),
                                     ("N 2 B H D", "2 N B H D", "zero_copy")]))
    if key not in agent_pairs:
        agent_pairs[key] = pair(key[0], key[1], path=key[2])
    p, d, pl, dl, peer = agent_pairs[key]
    n = data.draw(st.integers(1, 12))
    src = data.draw(st.lists(st.integers(0, 31), min_size=n, max_size=n))  # repeats allowed on P
    dst = data.draw(st.lists(st.integers(0, 31), min_size=n, max_size=n, unique=True))
    layers = data.draw(st.none() | st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True))
    req = f"h{data.draw(st.integers(0, 2**60))}"
    hr = d.recv(req, dst, layers=layers, timeout=T)
    p.send(peer, req, src).wait(T)
    hr.wait(T)
    assert torch.equal(kvxfer.pack(pl, src, layers=layers, backend="reference"),
                       kvxfer.pack(dl, dst, layers=layers, backend="reference"))


class _GatedBackend(LoopbackBackend):
    """Loopback whose writes wait for a gate: a transfer caught in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def post(self, conn, op, descs):
        self.entered.set()
        assert self.gate.wait(T)
        return super().post(conn, op, descs)


def test_receiver_timeout_mid_write_keeps_blocks_until_writer_quiet():
    """D's recv times out while P is inside the write: the recv ends (its handle fails)
    only once P is quiet, so its blocks are free when ``wait()`` returns."""
    released = []
    p_backend = _GatedBackend()
    p = Agent("p", secret=SECRET, backend=p_backend, config=AgentConfig(path="pack"))
    d = Agent("d", secret=SECRET, backend="loopback", on_release=lambda r, b, why: released.append((r, why)))
    try:
        p.register_kv(make_pool("2 N B H D", 1))
        d.register_kv(make_pool("2 N B H D", None))
        peer = p.connect(d.address)
        hs = p.send(peer, "slow", [1, 2])
        hr = d.recv("slow", [3, 4], timeout=0.5)
        assert p_backend.entered.wait(T)  # P is inside the write
        for _ in range(2000):  # until the recv's timeout ended it on D
            if "slow" not in d._receiver.recvs:
                break
            threading.Event().wait(0.01)
        assert "slow" not in d._receiver.recvs
        assert not hr.done()  # a late write may still land: the handle waits for the writer
        assert released == [] and d.held_blocks() == {"slow": (3, 4)}
        p_backend.gate.set()
        with pytest.raises(TransferTimeout):
            hr.wait(T)
        assert released == [("slow", "expired")] and d.held_blocks() == {}  # free when wait() returned
        with pytest.raises(TransferCancelled):
            hs.wait(T)
        for _ in range(500):
            if not p.held_blocks():
                break
            threading.Event().wait(0.01)
        assert p.held_blocks() == {} and d._state.pool.stage_in.used_bytes == 0
    finally:
        p_backend.gate.set()
        p.close()
        d.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_dtypes_and_send_before_recv(dtype):
    p, d, pl, dl, peer = pair(dtype=dtype)
    try:
        hs = p.send(peer, "early", [1, 2])  # P first: waits for D's post
        assert not hs.done()
        hr = d.recv("early", [3, 4], timeout=T)
        hr.wait(T)
        hs.wait(T)
        assert same(pl, [1, 2], dl, [3, 4])
    finally:
        p.close()
        d.close()


def test_64_concurrent_requests_one_peer():
    p, d, pl, dl, peer = pair(path="auto")
    try:
        # sends may share source blocks; D's 32 blocks take the even requests, then the odd
        recvs = [d.recv(f"q{i}", [i // 2], timeout=T) for i in range(0, 64, 2)]
        sends = [p.send(peer, f"q{i}", [(i * 7) % 32]) for i in range(64)]
        for h in recvs:
            h.wait(T)
        assert all(same(pl, [(i * 7) % 32], dl, [i // 2]) for i in range(0, 64, 2))
        recvs += [d.recv(f"q{i}", [i // 2], timeout=T) for i in range(1, 64, 2)]
        for h in sends + recvs:
            h.wait(T)
        assert all(same(pl, [(i * 7) % 32], dl, [i // 2]) for i in range(1, 64, 2))
        assert p.held_blocks() == {} and d.held_blocks() == {}
        assert p.metrics.counter("transfers", kind="send") == 64
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("path", ["zero_copy", "pack"])
def test_tp2_to_tp1_two_senders(path):
    d_layout = make_pool("N 2 H B D", None)
    d = Agent("d", secret=SECRET, backend="loopback", config=AgentConfig(path=path))
    d.register_kv(d_layout)
    ps = []
    try:
        for rank in range(2):
            a = Agent(f"p{rank}", secret=SECRET, backend="loopback", config=AgentConfig(path=path))
            a.register_kv(make_pool("2 N B H D", 10 + rank, tp_rank=rank, tp_size=2))
            ps.append(a)
        hr = d.recv("r", [6, 1, 20], timeout=T)
        handles = [a.send(a.connect(d.address), "r", [0, 5, 9]) for a in ps]
        hr.wait(T)
        for h in handles:
            h.wait(T)
        for rank, a in enumerate(ps):
            lo = rank * 2
            assert torch.equal(kvxfer.pack(a._state.layout, [0, 5, 9], backend="reference"),
                               kvxfer.pack(d_layout, [6, 1, 20], heads=(lo, lo + 2), backend="reference"))
    finally:
        for a in ps + [d]:
            a.close()


def test_tp1_to_tp2_one_sender_two_receivers():
    p = Agent("p", secret=SECRET, backend="loopback")
    p_layout = make_pool("2 N B H D", 3)
    p.register_kv(p_layout)
    ds = []
    try:
        for rank in range(2):
            a = Agent(f"d{rank}", secret=SECRET, backend="loopback")
            a.register_kv(make_pool("N 2 H B D", None, tp_rank=rank, tp_size=2))
            ds.append(a)
        recvs = [a.recv("r", [rank + 1, 8], timeout=T) for rank, a in enumerate(ds)]
        sends = [p.send(p.connect(a.address), "r", [4, 12]) for a in ds]
        for h in recvs + sends:
            h.wait(T)
        for rank, a in enumerate(ds):
            assert torch.equal(kvxfer.pack(p_layout, [4, 12], heads=(2 * rank, 2 * rank + 2), backend="reference"),
                               kvxfer.pack(a._state.layout, [rank + 1, 8], backend="reference"))
    finally:
        for a in ds + [p]:
            a.close()


@pytest.mark.parametrize("path", ["zero_copy", "pack"])
def test_layer_streaming(path):
    p, d, pl, dl, peer = pair(path=path)
    try:
        hr = d.recv("s", [1, 2, 3], timeout=T)
        for layer in range(pl.num_layers):
            hs = p.send_layer(peer, "s", layer, [4, 5, 6])
            hr.wait(T, layer=layer)
            assert layer in hr.layers_done
            assert torch.equal(kvxfer.pack(pl, [4, 5, 6], layers=[layer], backend="reference"),
                               kvxfer.pack(dl, [1, 2, 3], layers=[layer], backend="reference"))
            if layer < pl.num_layers - 1:
                assert not hr.done()
        hr.wait(T)
        hs.wait(T)
        with pytest.raises(ValueError):
            p.send_layer(peer, "s2", 99, [1])
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("path", ["zero_copy", "pack"])
def test_write_read_notify(path):
    p, d, pl, dl, peer = pair("2 N B H D", "N 2 H B D", path=path)
    try:
        h = p.write(peer, [7, 8], [0, 1], notify=b"req-7 ready")
        h.wait(T)
        assert same(pl, [7, 8], dl, [0, 1])
        got = []
        for _ in range(200):
            got += d.notifications()
            if got:
                break
            threading.Event().wait(0.01)
        assert [data for _, data in got] == [b"req-7 ready"]
        # read it back into other local blocks of P
        r = p.read(peer, [20, 21], [0, 1])
        r.wait(T)
        assert same(pl, [7, 8], pl, [20, 21])
    finally:
        p.close()
        d.close()


def test_cancel_timeout_and_lease_expiry_release_blocks():
    released = []
    p, d, pl, dl, peer = pair(lease_timeout=0.3, on_release=lambda r, b, why: released.append((r, b, why)))
    try:
        # P's lease expires: nobody posted "lonely"
        hs = p.send(peer, "lonely", [1, 2])
        with pytest.raises(TransferTimeout):
            hs.wait(T)
        # D's recv times out
        hr = d.recv("never", [3], timeout=0.2)
        with pytest.raises(TransferTimeout):
            hr.wait(T)
        # cancel on both sides
        hc = p.send(peer, "c1", [4])
        assert hc.cancel() and not hc.cancel()
        with pytest.raises(TransferCancelled):
            hc.wait(T)
        with d.recv("c2", [5], timeout=T) as hr2:
            pass
        assert hr2.state == "cancelled"
        for _ in range(500):
            if len(released) == 4 and not p.held_blocks() and not d.held_blocks():
                break
            threading.Event().wait(0.01)
        assert sorted(released) == sorted([("lonely", (1, 2), "expired"), ("never", (3,), "expired"),
                                           ("c1", (4,), "cancelled"), ("c2", (5,), "cancelled")])
        assert p.metrics.counter("failures", error="TransferTimeout") == 1
    finally:
        p.close()
        d.close()


def test_receiver_cancel_fails_matched_sender():
    p, d, pl, dl, peer = pair(path="pack")
    try:
        hs = p.send(peer, "x", [1])
        hr = d.recv("x", [2], timeout=T)
        hr.wait(T)  # completes; now a second one is cancelled by D before P sends
        hr2 = d.recv("y", [3], timeout=T)
        hr2.cancel()
        for _ in range(500):  # the CANCEL reaches P asynchronously
            if "y" in peer.book.tombstones:
                break
            threading.Event().wait(0.01)
        hs2 = p.send(peer, "y", [4])
        with pytest.raises(TransferCancelled):
            hs2.wait(T)
        hs.wait(T)
        hz = d.recv("w", [7], timeout=T)
        p.send(peer, "w", [8]).wait(T)
        hz.wait(T)
        assert hz.cancel() is False and hz.state == "done"  # cancel after completion is a no-op
    finally:
        p.close()
        d.close()


def test_metrics_repr_and_idempotent_close():
    p, d, pl, dl, peer = pair()
    h = d.recv("m", [1], timeout=T)
    p.send(peer, "m", [2]).wait(T)
    h.wait(T)
    assert "done" in repr(h) and "'m'" in repr(h) and "Agent" in repr(p) and "loopback" in repr(peer)
    m = p.metrics.to_dict()
    assert m["counters"]["bytes_sent"][0]["value"] == pl.wire_nbytes(1)
    assert m["info"]["transport:d"] == "loopback"
    got = d.metrics.to_dict()
    assert {"labels": {"kind": "recv", "path": "zero_copy"}, "value": 1} in got["counters"]["transfers"]
    assert "transfer_seconds" in got["histograms"]
    p.close()
    p.close()
    d.close()
    assert p.closed and not any(t.is_alive() for t in [p._sender.shipper.worker.thread, p._receiver.worker.thread,
                                                      p._state.loop.thread])
    with pytest.raises(KVXferError):
        p.send(peer, "after-close", [1])


def test_thousand_sequential_requests_flat_memory_no_leaks():
    psutil = pytest.importorskip("psutil")
    threads_before = threading.active_count()
    p, d, pl, dl, peer = pair()
    proc = psutil.Process()
    rss = None
    try:
        for i in range(1000):
            hr = d.recv(f"s{i}", [i % 32], timeout=T)
            p.send(peer, f"s{i}", [(i * 5) % 32]).wait(T)
            hr.wait(T)
            if i == 199:
                rss = proc.memory_info().rss
        grown = proc.memory_info().rss - rss
        assert grown < 16 << 20, f"RSS grew {grown} B over 800 requests"
        assert not p._sender.sends and not d._receiver.recvs and not p._sender.posts and not d._receiver.quiet_wait
        assert not p.held_blocks() and not d.held_blocks()
        assert d._state.pool.stage_in.used_bytes == 0
        nregions = len(pl.regions()) + 2
        assert p._state.backend.num_regions == nregions
    finally:
        p.close()
        d.close()
    assert p._state.backend.num_regions == 0 and d._state.backend.num_regions == 0
    for _ in range(100):
        if threading.active_count() <= threads_before:
            break
        threading.Event().wait(0.02)
    assert threading.active_count() <= threads_before


def test_disconnect_fails_pending_sends_and_refuses_new_ones():
    from kvxfer.errors import PeerDisconnected

    released = []
    p, d, pl, dl, peer = pair(on_release=lambda r, b, why: released.append((r, why)))
    try:
        hs = p.send(peer, "pending", [1, 2])  # D never posts it
        assert len(p.peers()) == 1
        p.disconnect(peer)
        with pytest.raises(PeerDisconnected):
            hs.wait(T)
        assert not peer.is_connected and ("pending", "failed") in released
        with pytest.raises(PeerDisconnected):
            p.send(peer, "later", [3])
        for _ in range(500):  # D notices the closed connection too
            if not d.peers():
                break
            threading.Event().wait(0.01)
        assert d.peers() == [] and p.peers() == []
    finally:
        p.close()
        d.close()


class _NeverCompletes(LoopbackBackend):
    """A backend whose posted writes never complete, so every wait times out."""

    def test(self, request_id: int) -> bool:
        return False


def test_backend_timeout_names_the_request_id():
    p_layout, d_layout = make_pool("2 N B H D", 1), make_pool("2 N B H D", None)
    p = Agent("p", secret=SECRET, backend=_NeverCompletes(), config=AgentConfig(path="zero_copy"))
    d = Agent("d", secret=SECRET, backend="loopback", config=AgentConfig(path="zero_copy"))
    try:
        p.register_kv(p_layout)
        d.register_kv(d_layout)
        peer = p.connect(d.address)
        hr = d.recv("req-named-in-errors", [1, 2], timeout=T)
        hs = p.send(peer, "req-named-in-errors", [3, 4], lease_timeout=1.0)
        with pytest.raises(TransferTimeout, match="'req-named-in-errors': write to 'd'"):
            hs.wait(T)
        hr.cancel()
    finally:
        p.close()
        d.close()


class _TargetDrivenBackend(LoopbackBackend):
    """Loopback that behaves like ``ucx:tcp+am-rma``: a write completes only once the
    target answered (here: once the test opens ``gate``), and the transport needs the
    target's progress. Records the thread each wait ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self.wait_threads: list = []

    def needs_progress(self, conn) -> bool:
        return True

    def wait(self, request_id, timeout):
        self.wait_threads.append(threading.current_thread())
        self.waiting.set()
        assert self.gate.wait(T)
        return super().wait(request_id, timeout)


def test_a_write_that_waits_for_its_target_never_blocks_the_io_thread():
    """A small zero-copy piece is written inline only where ``post`` completes by itself:
    on a transport whose write waits for the target, the I/O thread that matched the
    RECV_POST must stay free for every other peer's frames (here: a handshake)."""
    backend = _TargetDrivenBackend()
    p = Agent("p", secret=SECRET, backend=backend, config=AgentConfig(path="zero_copy"))
    d = Agent("d", secret=SECRET, backend="loopback")
    other = Agent("other", secret=SECRET, backend="loopback")
    try:
        p.register_kv(make_pool("2 N B H D", 1))
        d.register_kv(make_pool("2 N B H D", None))
        other.register_kv(make_pool("2 N B H D", None))
        peer = p.connect(d.address)
        hs = p.send(peer, "r", [1])  # before the recv: P's I/O thread matches the RECV_POST
        hr = d.recv("r", [2], timeout=T)
        assert backend.waiting.wait(T)  # the write is in flight, waiting for its target
        assert p._state.loop.thread not in backend.wait_threads
        other.connect(p.address, timeout=5.0)  # P's I/O thread runs this handshake meanwhile
        backend.gate.set()
        hs.wait(T)
        hr.wait(T)
    finally:
        backend.gate.set()
        for agent in (p, d, other):
            agent.close()
