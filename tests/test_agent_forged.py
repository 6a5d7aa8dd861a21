"""An authenticated peer that lies: forged
RECV_POSTs, DATA_DONEs and staging frames, sent over a real control connection
between two agents. Each lie fails only its own request, with a typed error on
both sides; threads, staging space and other requests survive."""
from __future__ import annotations

import time

import pytest
import torch

import kvxfer
from kvxfer import Agent, AgentConfig
from kvxfer.framing import encode_frame
from kvxfer.agent.protocol import Msg, encode
from kvxfer.agent.datapath import _GrantWait
from kvxfer.errors import InvalidDescriptor, ProtocolError

from agent_procs import SECRET, make_pool

T = 20.0
L, N, H = 4, 32, 4  # agent_procs.SHAPE


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + T
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def agents():
    made = []

    def make(path="pack", d_dims="N 2 H B D"):
        p = Agent("p", secret=SECRET, backend="loopback", config=AgentConfig(path=path))
        d = Agent("d", secret=SECRET, backend="loopback", config=AgentConfig(path=path))
        made.extend([p, d])
        p.register_kv(make_pool("2 N B H D", 1))
        d.register_kv(make_pool(d_dims, None))
        return p, d

    yield make
    for a in made:
        a.close()


def _peer_of(agent):
    _until(lambda: agent.peers(), "the peer")
    return agent.peers()[0]


def _good_transfer(p, d, peer, req="good"):
    src, dst = [9, 3, 20], [4, 17, 30]
    hr = d.recv(req, dst, timeout=T)
    hs = p.send(peer, req, src)
    hs.wait(T)
    hr.wait(T)
    assert torch.equal(kvxfer.pack(p._state.layout, src, backend="reference"),
                       kvxfer.pack(d._state.layout, dst, backend="reference"))


@pytest.mark.parametrize("path", ["pack", "zero_copy"])
@pytest.mark.parametrize("bad", ["layer", "block", "heads", "dup_block"])
def test_bad_recv_post_fails_that_request_on_both_sides_and_no_worker(agents, path, bad):
    p, d = agents(path)
    fields = dict(blocks=[1, 2], layers=list(range(L)), heads=(0, H))
    fields.update({"layer": dict(layers=[0, L]), "block": dict(blocks=[1, N]), "heads": dict(heads=(0, H + 1)),
                   "dup_block": dict(blocks=[2, 2])}[bad])
    hr = d.recv("evil", [1, 2], timeout=60.0)  # before any peer: the post goes out on connect
    op = d._receiver.recvs["evil"]
    op.post_frame = encode(Msg.RECV_POST, req="evil", xid=op.xid, skip=0, **fields)
    peer = p.connect(d.address)
    hs = p.send(peer, "evil", [3, 4])
    with pytest.raises(InvalidDescriptor):
        hs.wait(T)
    with pytest.raises(InvalidDescriptor):
        hr.wait(T)
    assert all(t.is_alive() for a in (p, d) for t in (a._sender.shipper.worker.thread, a._receiver.worker.thread))
    _until(lambda: not p.held_blocks() and not d.held_blocks(), "leases released")
    _good_transfer(p, d, peer)  # pack and > 4 MiB sends need the send worker
    assert peer.is_connected


def test_worker_survives_a_raising_job(agents, caplog):
    p, d = agents("pack")
    peer = p.connect(d.address)

    def boom():
        raise IndexError("a bug")

    with caplog.at_level("ERROR", logger="kvxfer"):
        p._sender.shipper.worker.submit(boom)
        _good_transfer(p, d, peer)
    assert any("a bug" in (r.exc_text or "") for r in caplog.records)


def _grant(p, peer, tag, nbytes):
    wait = p._sender.shipper._grant_waits[tag] = _GrantWait(peer)
    peer.send(encode(Msg.STAGE_REQ, tag=tag, nbytes=nbytes))
    assert wait.event.wait(T)
    return wait.offset


@pytest.mark.parametrize("bad", [dict(layers=[L]), dict(heads=(0, H + 3)), dict(layers=[])])
def test_bad_pack_data_done_frees_its_grant(agents, bad):
    p, d = agents("pack")
    peer = p.connect(d.address)
    nbytes = d.config.staging_bytes // 2  # two leaked grants would fill D's ring for good
    hr = d.recv("r", [1], timeout=60.0)
    xid = d._receiver.recvs["r"].xid
    peer.send(encode(Msg.MATCHED, req="r", xid=xid))
    for tag in (901, 902):
        off = _grant(p, peer, tag, nbytes)
        f = dict(req="r", xid=xid, tag=tag, pack=True, blocks=[1], layers=[0], heads=(0, H), offset=off,
                 nbytes=nbytes)
        f.update(bad)
        peer.send(encode(Msg.DATA_DONE, **f))
    with pytest.raises(InvalidDescriptor):
        hr.wait(T)
    _until(lambda: d._state.pool.stage_in.used_bytes == 0 and not d._receiver.grants, "grants freed")
    _good_transfer(p, d, peer)


def test_zero_copy_data_done_must_match_the_request(agents):
    p, d = agents("zero_copy")
    peer = p.connect(d.address)
    # nothing written, 0 bytes claimed
    hr = d.recv("z", [1, 2], timeout=60.0)
    xid = d._receiver.recvs["z"].xid
    peer.send(encode(Msg.MATCHED, req="z", xid=xid))
    peer.send(encode(Msg.DATA_DONE, req="z", xid=xid, tag=0, pack=False, blocks=[], layers=list(range(L)),
                     heads=(0, H), offset=0, nbytes=0))
    with pytest.raises(InvalidDescriptor):
        hr.wait(T)
    # a DATA_DONE from a peer that never said it would write this request
    hr2 = d.recv("z2", [3], timeout=60.0)
    xid2 = d._receiver.recvs["z2"].xid
    peer.send(encode(Msg.DATA_DONE, req="z2", xid=xid2, tag=0, pack=False, blocks=[], layers=list(range(L)),
                     heads=(0, H), offset=0, nbytes=d._state.layout.wire_nbytes(1)))
    with pytest.raises(ProtocolError):
        hr2.wait(T)
    _good_transfer(p, d, peer)


def test_pack_chunk_naming_another_requests_blocks_is_refused(agents):
    p, d = agents("pack")
    peer = p.connect(d.address)
    ha = d.recv("a", [1, 2], timeout=60.0)
    hb = d.recv("b", [5, 6], timeout=60.0)
    xid = d._receiver.recvs["a"].xid
    peer.send(encode(Msg.MATCHED, req="a", xid=xid))
    nbytes = d._state.layout.wire_nbytes(2)
    off = _grant(p, peer, 903, nbytes)
    d._state.pool.stage_in_t[off:off + nbytes] = 7  # what a forged chunk would scatter
    peer.send(encode(Msg.DATA_DONE, req="a", xid=xid, tag=903, pack=True, blocks=[5, 6], layers=list(range(L)),
                     heads=(0, H), offset=off, nbytes=nbytes))
    with pytest.raises(InvalidDescriptor):
        ha.wait(T)
    assert not hb.done()
    assert not kvxfer.pack(d._state.layout, [1, 2, 5, 6], backend="reference").any()  # nothing scattered
    hb.cancel()
    _until(lambda: d._state.pool.stage_in.used_bytes == 0, "staging freed")
    _good_transfer(p, d, peer)


def test_sender_layers_must_cover_the_receivers(agents):
    p, d = agents("zero_copy")
    peer = p.connect(d.address)
    # a failed recv's blocks stay leased until P confirmed it stopped: the second uses others
    for req, ids, send_layers, recv_layers in [("sub", [1, 2], [0, 1], None), ("disjoint", [7, 8], [0], [1])]:
        hr = d.recv(req, ids, layers=recv_layers, timeout=60.0)
        hs = p.send(peer, req, [3, 4], layers=send_layers)
        with pytest.raises(InvalidDescriptor):
            hs.wait(T)
        with pytest.raises(InvalidDescriptor):
            hr.wait(T)
        assert hs.nbytes == 0
    # a sender's layers that cover a subset asked for are fine
    hr = d.recv("fine", [5], layers=[2], timeout=T)
    p.send(peer, "fine", [6], layers=[1, 2]).wait(T)
    hr.wait(T)
    assert torch.equal(kvxfer.pack(p._state.layout, [6], layers=[2], backend="reference"),
                       kvxfer.pack(d._state.layout, [5], layers=[2], backend="reference"))


def _raw(msg: Msg, *fields) -> bytes:
    """A frame of ``msg`` with a binary payload built field by field (``kvxfer.agent.protocol``
    layout), so a test can put a value there that no encoder would write."""
    import struct

    out = b""
    for kind, v in fields:
        if kind == "str":
            raw = v.encode()
            out += struct.pack("<H", len(raw)) + raw
        elif kind == "int":
            out += struct.pack("<Q", v)
        elif kind == "ints":
            out += struct.pack("<BI", 4, len(v)) + struct.pack(f"<{len(v)}I", *v)
        elif kind == "range":
            out += struct.pack("<II", *v)
        else:  # "u8": a raw byte (a bool field)
            out += bytes([v])
    return encode_frame(int(msg), out)


def _post_fields(req, xid, heads=(0, H)):
    return [("str", req), ("int", xid), ("ints", [1, 2]), ("ints", list(range(L))), ("range", heads), ("int", 0)]


@pytest.mark.parametrize("path", ["zero_copy", "pack"])
def test_malformed_message_fails_its_request_and_keeps_the_connection(agents, path):
    p, d = agents(path)
    peer = p.connect(d.address)  # P's view of D
    d_peer = _peer_of(d)  # D's view of P
    bystander = d.recv("by", [1, 2], timeout=T)  # pending on the same connection throughout
    # D -> P: a RECV_POST whose head range is a > b; its request (req, xid) decodes
    hs = p.send(peer, "bad", [3])
    d_peer.send(_raw(Msg.RECV_POST, *_post_fields("bad", 77, heads=(5, 2))))
    with pytest.raises(ProtocolError, match="malformed"):
        hs.wait(T)
    # D -> P: a RECV_POST whose request id is over the wire's 256 characters: names no request
    d_peer.send(_raw(Msg.RECV_POST, *_post_fields("x" * 300, 78)))
    # P -> D: a DATA_DONE whose bool field is 2, holding a real staging grant
    hr = d.recv("bad2", [9], timeout=T)
    xid = d._receiver.recvs["bad2"].xid
    peer.send(encode(Msg.MATCHED, req="bad2", xid=xid))
    nbytes = d._state.layout.wire_nbytes(1)
    off = _grant(p, peer, 904, nbytes)
    peer.send(_raw(Msg.DATA_DONE, ("str", "bad2"), ("int", xid), ("int", 904), ("u8", 2), ("ints", [9]),
                   ("ints", list(range(L))), ("range", (0, H)), ("int", off), ("int", nbytes)))
    with pytest.raises(ProtocolError, match="malformed"):
        hr.wait(T)
    _until(lambda: d._state.pool.stage_in.used_bytes == 0 and not d._receiver.grants, "the grant freed")
    # the connection stayed up: the bystander completes with the right bytes
    p.send(peer, "by", [5, 6]).wait(T)
    bystander.wait(T)
    assert torch.equal(kvxfer.pack(p._state.layout, [5, 6], backend="reference"),
                       kvxfer.pack(d._state.layout, [1, 2], backend="reference"))
    _good_transfer(p, d, peer)
    assert peer.is_connected and d_peer.is_connected
    assert p.metrics.counter("malformed_messages", kind="RECV_POST") == 2
    assert d.metrics.counter("malformed_messages", kind="DATA_DONE") == 1
    _until(lambda: not p.held_blocks() and not d.held_blocks(), "leases released")
