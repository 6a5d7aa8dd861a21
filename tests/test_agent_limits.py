"""Per-peer bounds (issue 9, items 7 and 14): an authenticated peer that floods
RECV_POSTs, NOTIFYs or STAGE_REQs, or a client that streams bytes before
authenticating, is bounded on its own; the other peers keep working."""
from __future__ import annotations

import socket
import time

import pytest
import torch

import kvxfer
from kvxfer import Agent
from kvxfer.control import limits
from kvxfer.control.framing import HEADER
from kvxfer.control.messages import Msg, encode

from agent_procs import SECRET, make_pool

T = 20.0


def _until(cond, what: str, limit: float = T) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _agent(name, seed):
    a = Agent(name, secret=SECRET, backend="loopback")
    a.register_kv(make_pool("2 N B H D", seed))
    return a


@pytest.fixture
def agents():
    made = []

    def make(name, seed=None):
        made.append(_agent(name, seed))
        return made[-1]

    yield make
    for a in made:
        a.close()


def _roundtrip(p, peer, d, req):
    hr = d.recv(req, [3, 4], timeout=T)
    p.send(peer, req, [5, 6]).wait(T)
    hr.wait(T)
    assert torch.equal(kvxfer.pack(p._state.layout, [5, 6], backend="reference"),
                       kvxfer.pack(d._state.layout, [3, 4], backend="reference"))


def _peer_named(agent, name):
    _until(lambda: any(q.name == name for q in agent.peers()), f"peer {name}")
    return next(q for q in agent.peers() if q.name == name)


def test_cached_posts_are_bounded_per_peer_and_never_cost_another_peer(agents):
    p = agents("p", 1)
    flood, good = agents("flood"), agents("good")
    flood.connect(p.address)
    good_peer = good.connect(p.address)
    to_p = _peer_named(flood, "p")
    n = 70000  # more than the old shared limit of 65,536
    blob = b"".join(encode(Msg.RECV_POST, req=f"f{i}", xid=i + 1, blocks=[i % 32], layers=[0, 1, 2, 3],
                           heads=(0, 4), skip=0) for i in range(n))
    assert to_p.conn.send(blob)
    book = _peer_named(p, "flood").book
    t0 = time.monotonic()
    _until(lambda: f"f{n - 1}" in book.posts, "the flood to land", 120.0)
    print(f"{n} posts in {time.monotonic() - t0:.1f} s")
    assert len(p._sender.posts) <= limits.MAX_POSTS_PER_PEER
    # the other peer is still connected and served
    hr = good.recv("legit", [3, 4], timeout=T)
    p_of_good = _peer_named(p, "good")
    p.send(p_of_good, "legit", [5, 6]).wait(T)
    hr.wait(T)
    assert good_peer.is_connected and p_of_good.is_connected


def test_notify_flood_closes_only_the_flooding_peer(agents):
    d = agents("d")
    flood, good = agents("flood", 1), agents("good", 2)
    flood_peer = flood.connect(d.address)
    good_peer = good.connect(d.address)
    data = b"n" * limits.MAX_NOTIFY_BYTES
    frame = encode(Msg.NOTIFY, data=data)
    for _ in range(limits.MAX_NOTE_BYTES_PER_PEER // len(data) + 8):  # nobody drains on D
        if not flood_peer.conn.send(frame):
            break
    _until(lambda: not flood_peer.is_connected, "D to drop the flooding peer")
    queued = sum(len(b) for _, b in d.notifications())
    assert queued <= limits.MAX_NOTE_BYTES_PER_PEER
    _roundtrip(good, good_peer, d, "after-notify")
    with pytest.raises(ValueError):  # the sending side refuses an oversized payload up front
        good.write(good_peer, [1], [1], notify=b"x" * (limits.MAX_NOTIFY_BYTES + 1))


def test_oversized_notify_closes_that_peer(agents):
    d = agents("d")
    flood = agents("flood", 1)
    peer = flood.connect(d.address)
    peer.conn.send(encode(Msg.NOTIFY, data=b"n" * (limits.MAX_NOTIFY_BYTES + 1)))
    _until(lambda: not peer.is_connected, "D to drop the peer")
    assert d.notifications() == []


def test_stage_req_flood_closes_only_the_flooding_peer(agents):
    d = agents("d")
    flood, good = agents("flood", 1), agents("good", 2)
    flood_peer = flood.connect(d.address)
    good_peer = good.connect(d.address)
    seen = []
    blob = b"".join(encode(Msg.STAGE_REQ, tag=10 ** 6 + i, nbytes=256) for i in range(2000))
    flood_peer.conn.send(blob)
    _until(lambda: not flood_peer.is_connected or (seen.append(len(d._receiver.grants)) and False), "the flood")
    assert max(seen, default=0) <= limits.MAX_STAGE_REQS_PER_PEER
    _until(lambda: d._state.pool.stage_in.used_bytes == 0 and not d._receiver.grants, "its grants freed")
    _roundtrip(good, good_peer, d, "after-stage")


def test_unauthenticated_client_buffers_at_most_a_few_kib():
    d = _agent("d", None)
    try:
        host, port = d.address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=T)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        biggest = 0
        try:
            s.sendall(HEADER.pack(b"KX", 1, int(Msg.HELLO), 3 << 20))
            s.settimeout(0.05)
            for _ in range(64):  # 2 MiB of a claimed 3 MiB HELLO
                try:
                    s.sendall(b"\0" * (32 << 10))
                except (socket.timeout, OSError):
                    break
                biggest = max([biggest] + [c.reader.pending_bytes for c in list(d._state.loop._conns)])
        finally:
            s.close()
        assert biggest <= 4096
    finally:
        d.close()
