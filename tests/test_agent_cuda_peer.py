"""Same-node peer copies (``transport="cuda_peer"``) on CPU: host pools stand for the GPU
pools, :class:`host_ipc.HostIpc` for CUDA IPC, the Triton kernel runs in the interpreter.

What is checked: a whole request moves with one launch, bitwise, across layouts and TP
splits; the peer's pool is mapped once and unmapped on disconnect and close; an offer
that names more than its allocation, another node, a failing driver or a disabled
config leaves the peer on the backend's paths (still bitwise); a malformed offer fails
the handshake; one-sided reads and writes take the mapping too.
"""
from __future__ import annotations

import os

import pytest
import torch

import kvxfer
from kvxfer import Agent, AgentConfig
from kvxfer.errors import ProtocolError
from kvxfer.transport import cuda_peer

from agent_procs import SECRET, make_pool
from host_ipc import HostIpc, HostPeerDevice

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="host pools run the Triton kernel only in the interpreter")
T = 20.0
SHAPE = dict(L=2, N=8, B=2, H=4, D=4)


def agent(name, layout, *, ipc=None, config=None):
    ipc = ipc if ipc is not None else HostIpc()
    ipc.add_layout(layout)
    a = Agent(name, secret=SECRET, backend="loopback", config=config or AgentConfig(),
              device=HostPeerDevice(ipc))
    a.register_kv(layout)
    return a


def pools(p_dims="2 N B H D", d_dims="2 N B H D", p_tp=(0, 1), d_tp=(0, 1)):
    return (make_pool(p_dims, 1, tp_rank=p_tp[0], tp_size=p_tp[1], shape=SHAPE),
            make_pool(d_dims, None, tp_rank=d_tp[0], tp_size=d_tp[1], shape=SHAPE))


def same(src, src_ids, dst, dst_ids, heads=None) -> bool:
    return torch.equal(kvxfer.pack(src, src_ids, heads=heads, backend="reference"),
                       kvxfer.pack(dst, dst_ids, heads=heads, backend="reference"))


def move(p, d, peer, src_ids, dst_ids, req="r"):
    hr = d.recv(req, dst_ids, timeout=T)
    hs = p.send(peer, req, src_ids)
    hs.wait(T)
    hr.wait(T)
    return hs, hr


@pytest.mark.parametrize("p_dims,d_dims", [("2 N B H D", "2 N B H D"), ("2 N B H D", "N 2 H B D"),
                                           ("L N 2 B H D", "2 N B H D"), ("N 2 H B D", "L 2 N B H D")])
def test_one_launch_bitwise_across_layouts(p_dims, d_dims):
    src, dst = pools(p_dims, d_dims)
    p, d = agent("p", src), agent("d", dst)
    try:
        peer = p.connect(d.address)
        assert peer.device_transport == "cuda_peer" and peer.link.state == "offered"
        src_ids, dst_ids = [5, 0, 7, 3], [1, 6, 2, 4]
        hs, hr = move(p, d, peer, src_ids, dst_ids)
        assert hs.path == "cuda_peer" and hr.path == "zero_copy"  # D cannot tell: bytes landed in its blocks
        assert same(src, src_ids, dst, dst_ids)
        assert p._state.device.copies == 1  # the whole request, every layer and K/V: one launch
        assert peer.link.state == "mapped"
        untouched = [b for b in range(SHAPE["N"]) if b not in dst_ids]
        assert torch.count_nonzero(kvxfer.pack(dst, untouched, backend="reference")) == 0
        sent = p.metrics.to_dict()["counters"]["bytes_sent"]
        assert [c["value"] for c in sent if c["labels"] == {"path": "cuda_peer"}] == [hs.nbytes]
    finally:
        p.close()
        d.close()


def test_heterogeneous_tp_two_senders_fill_one_receiver():
    """P ranks of TP 2 each write their half of the heads into one TP 1 pool."""
    d_pool = make_pool("2 N B H D", None, shape=SHAPE)
    d = agent("d", d_pool)
    ranks = [make_pool("2 N B H D", 10 + r, tp_rank=r, tp_size=2, shape=SHAPE) for r in range(2)]
    senders = [agent(f"p{r}", ranks[r]) for r in range(2)]
    try:
        peers = [s.connect(d.address) for s in senders]
        hr = d.recv("r", [3, 1], timeout=T)
        for s, peer in zip(senders, peers):
            s.send(peer, "r", [0, 6]).wait(T)
        hr.wait(T)
        for r, pool in enumerate(ranks):
            assert same(pool, [0, 6], d_pool, [3, 1], heads=pool.head_range)
        assert all(s._state.device.copies == 1 for s in senders)
    finally:
        for a in (*senders, d):
            a.close()


def test_receiver_of_tp_two_takes_its_heads_from_one_sender():
    src = make_pool("2 N B H D", 3, shape=SHAPE)
    p = agent("p", src)
    ranks = [make_pool("N 2 H B D", None, tp_rank=r, tp_size=2, shape=SHAPE) for r in range(2)]
    receivers = [agent(f"d{r}", ranks[r]) for r in range(2)]
    try:
        peers = [p.connect(d.address) for d in receivers]
        handles = [d.recv(f"r{r}", [2, 5], timeout=T) for r, d in enumerate(receivers)]
        for r, peer in enumerate(peers):
            h = p.send(peer, f"r{r}", [4, 1])
            h.wait(T)
            assert h.path == "cuda_peer"
        for h in handles:
            h.wait(T)
        for pool in ranks:
            assert same(src, [4, 1], pool, [2, 5], heads=pool.head_range)
    finally:
        for a in (p, *receivers):
            a.close()


def test_mapped_once_then_unmapped_on_disconnect_and_close():
    src, dst = pools()
    ipc = HostIpc()
    p, d = agent("p", src, ipc=ipc), agent("d", dst)
    try:
        peer = p.connect(d.address)
        for i in range(3):
            move(p, d, peer, [i, i + 1], [7 - i, i], req=f"r{i}")
        assert sum(ipc.opens.values()) == len(dst.tensors) == ipc.mapped  # one open per allocation, kept
        p.disconnect(peer)
        _until(lambda: ipc.mapped == 0)
        assert peer.link.state == "closed"
        peer2 = p.connect(d.address)
        move(p, d, peer2, [1], [1], req="again")
        assert ipc.mapped == len(dst.tensors)
    finally:
        p.close()
        d.close()
    assert ipc.mapped == 0 and len(cuda_peer.HANDLES) == 0  # closing the agent unmaps what it mapped


def test_two_agents_of_one_process_share_one_mapping():
    """CUDA opens a handle once per context: the process-wide cache counts references."""
    src, dst = pools()
    other = make_pool("2 N B H D", 2, shape=SHAPE)
    ipc = HostIpc()
    p1, p2, d = agent("p1", src, ipc=ipc), agent("p2", other, ipc=ipc), agent("d", dst)
    try:
        a, b = p1.connect(d.address), p2.connect(d.address)
        move(p1, d, a, [0], [0], req="a")
        move(p2, d, b, [1], [1], req="b")
        assert sum(ipc.opens.values()) == len(dst.tensors)  # the second agent reused the first's mapping
        p1.close()
        assert ipc.mapped == len(dst.tensors)  # still referenced by p2
        move(p2, d, b, [2], [2], req="c")
        assert same(other, [1, 2], dst, [1, 2])
    finally:
        for x in (p1, p2, d):
            x.close()
    assert ipc.mapped == 0


def test_region_larger_than_its_allocation_is_refused_and_ucx_carries_it():
    """A peer can only be reached in ranges it advertised *and* owns: if the driver maps a
    smaller allocation than the offer claims, nothing is mapped and the backend moves it."""
    src, dst = pools()
    ipc = HostIpc()
    ipc.shrink = 64
    p, d = agent("p", src, ipc=ipc), agent("d", dst)
    try:
        peer = p.connect(d.address)
        hs, _ = move(p, d, peer, [1, 2], [3, 4])
        assert hs.path in ("zero_copy", "pack") and peer.link.state == "failed"
        assert "outside its allocation" in peer.link.error
        assert peer.device_transport != "cuda_peer"
        assert same(src, [1, 2], dst, [3, 4])
        assert ipc.mapped == 0 and p._state.device.copies == 0
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("case", ["open_fails", "other_node", "disabled", "export_fails"])
def test_without_a_mapping_the_backend_carries_it(case, monkeypatch):
    src, dst = pools()
    ipc, d_ipc = HostIpc(), HostIpc()
    cfg = None
    if case == "open_fails":
        ipc.fail_open = True
    elif case == "disabled":
        cfg = AgentConfig(peer_copy=False)
    elif case == "export_fails":
        d_ipc.fail_export = True
    d = agent("d", dst, ipc=d_ipc)
    if case == "other_node":
        monkeypatch.setattr(cuda_peer, "node_id", lambda: "another-boot-id")
    p = agent("p", src, ipc=ipc, config=cfg)
    try:
        peer = p.connect(d.address)
        hs, _ = move(p, d, peer, [6, 2], [0, 5])
        assert hs.path in ("zero_copy", "pack")
        assert same(src, [6, 2], dst, [0, 5])
        assert p._state.device.copies == 0 and ipc.mapped == 0
        if case == "export_fails":
            assert d._state.pool.peer_offer == {}
    finally:
        p.close()
        d.close()


def test_malformed_offer_fails_the_handshake(monkeypatch):
    src, dst = pools()
    d = agent("d", dst)
    p = agent("p", src)
    try:
        offer = d._state.pool.peer_offer
        bad = dict(offer, regions=[[r[0], r[1], r[2] + 8] for r in offer["regions"]])  # sizes not the regions'
        monkeypatch.setattr(d._state.pool, "peer_offer", bad)
        with pytest.raises(ProtocolError):
            p.connect(d.address)
    finally:
        p.close()
        d.close()


def test_one_sided_write_and_read_take_the_mapping():
    src, dst = pools()
    p, d = agent("p", src), agent("d", dst)
    try:
        peer = p.connect(d.address)
        h = p.write(peer, [3, 4], [6, 7], notify=b"done")
        h.wait(T)
        assert h.path == "cuda_peer" and same(src, [3, 4], dst, [6, 7])
        _until(lambda: d.notifications() != [])
        back = make_pool("2 N B H D", None, shape=SHAPE)
        reader = agent("reader", back)
        try:
            rpeer = reader.connect(p.address)
            h = reader.read(rpeer, [0, 1], [5, 0])
            h.wait(T)
            assert h.path == "cuda_peer" and same(src, [5, 0], back, [0, 1])
        finally:
            reader.close()
    finally:
        p.close()
        d.close()


def test_mapped_layout_refuses_strides_that_are_not_whole_elements():
    src, _ = pools()
    geo = kvxfer.transport.descriptors.Geometry.from_layout(src)
    bad = geo.__class__(**{**{f: getattr(geo, f) for f in geo.__dataclass_fields__},
                           "planes": tuple((r, o + 1, *st) for r, o, *st in geo.planes)})
    with pytest.raises(cuda_peer.PeerMapError):
        cuda_peer.mapped_layout(bad, [t.data_ptr() for t in src.tensors], src)


def _until(cond, timeout=T):
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
