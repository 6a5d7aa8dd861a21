"""Per-peer and per-agent bounds:
an authenticated peer that floods RECV_POSTs, NOTIFYs or STAGE_REQs, or a client
that streams bytes before authenticating, is bounded on its own; the other peers
keep working; many peers together stay under the agent's totals; what a peer made
the agent hold goes when it disconnects. The RSS of a refused-post flood:
``benchmarks/post_flood.py``."""
from __future__ import annotations

import socket
import time

import pytest
import torch

import kvxfer
from kvxfer import Agent
from kvxfer import config as limits
from kvxfer.agent.peers import AgentBook, tombstone_nbytes
from kvxfer.framing import HEADER
from kvxfer.agent.protocol import Msg, encode

from agent_procs import SECRET, make_pool

T = 20.0


def _until(cond, what: str, limit: float = T) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _agent(name, seed, config=None):
    a = Agent(name, secret=SECRET, backend="loopback", config=config)
    a.register_kv(make_pool("2 N B H D", seed))
    return a


@pytest.fixture
def agents():
    made = []

    def make(name, seed=None, config=None):
        made.append(_agent(name, seed, config))
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


def _refused_posts(n, prefix, num_ids=0, req_len=0):
    """``n`` RECV_POSTs P must refuse: ``num_ids`` block ids (beyond any 32-block pool), or
    one repeated id; request ids padded to ``req_len`` characters."""
    blocks = list(range(64, 64 + num_ids)) if num_ids else [1, 1]
    return b"".join(encode(Msg.RECV_POST, req=f"{prefix}{i}".ljust(req_len, "x"), xid=i + 1, blocks=blocks,
                           layers=[0, 1, 2, 3], heads=(0, 4), skip=0) for i in range(n))


def _plain(value) -> bool:
    return value is None or type(value) in (int, str) or (type(value) is tuple and all(map(_plain, value)))


def test_refused_posts_leave_small_plain_tombstones_that_go_with_the_peer(agents):
    p = agents("p", 1)
    flood = agents("flood")
    flood.connect(p.address)
    to_p = _peer_named(flood, "p")
    for i in range(8):  # 8 posts of 100k block ids: each must not keep its ids and traceback
        assert to_p.conn.send(_refused_posts(1, f"big{i}-", num_ids=100_000))
        _until(lambda: len(to_p.conn._out) == 0, "the post to go out")
    assert to_p.conn.send(_refused_posts(3000, "long-", req_len=250))  # 3000 x 250-char ids
    _roundtrip(p, _peer_named(p, "flood"), flood, "after-refused")  # behind every refused post
    book = _peer_named(p, "flood").book
    lim = p.config.limits
    assert book.tombstones and all(_plain(t) for t in book.tombstones.values())
    xid, code, reason = book.unbury("long-2999".ljust(250, "x"))
    assert code == "invalid" and "distinct" in reason and len(reason) <= 200
    assert book.tombstone_bytes <= lim.max_tombstone_bytes
    assert book.tombstone_bytes == sum(t[3] for t in book.tombstones.values())
    assert len(book.tombstones) < 3000  # the byte bound, not just the count, dropped the oldest
    books = p._conns.books
    assert books.tombstone_bytes == book.tombstone_bytes and books.num_tombstones == len(book.tombstones)
    flood.close()
    _until(lambda: not p.peers(), "the peer to go")
    assert not book.tombstones and not book.posts
    assert books.num_tombstones == books.tombstone_bytes == books.num_posts == books.posted_blocks == 0
    assert books.books == {}


def test_cached_posts_and_tombstones_are_bounded_per_agent(agents):
    lim = limits.PeerLimits(max_agent_posts=100, max_agent_posted_blocks=150, max_agent_tombstones=120,
                            max_agent_tombstone_bytes=200 * tombstone_nbytes("t-00", "x" * 64))
    p = agents("p", 1, config=kvxfer.AgentConfig(limits=lim))
    floods = [agents(f"flood{k}") for k in range(4)]
    for k, f in enumerate(floods):
        f.connect(p.address)
        to_p = _peer_named(f, "p")
        blob = b"".join(encode(Msg.RECV_POST, req=f"f{i}", xid=i + 1, blocks=[i % 32], layers=[0, 1, 2, 3],
                               heads=(0, 4), skip=0) for i in range(60))  # each under every per-peer cap
        assert to_p.conn.send(blob + _refused_posts(60, "t-"))
        _roundtrip(p, _peer_named(p, f"flood{k}"), f, f"after-{k}")
    books = p._conns.books
    peers = [_peer_named(p, f"flood{k}") for k in range(4)]
    assert books.num_posts == len(p._sender.posts) == sum(len(q.book.posts) for q in peers) <= 100
    assert books.posted_blocks <= 150 and books.num_tombstones <= 120
    assert books.tombstone_bytes <= lim.max_agent_tombstone_bytes
    # the agent-wide bounds took the oldest entries of whoever held the most: equal shares remain
    for table in ("posts", "tombstones"):
        sizes = [len(getattr(q.book, table)) for q in peers]
        assert max(sizes) - min(sizes) <= 2, (table, sizes)  # the newcomer counts after the eviction
    assert all(f"f{59 - i}" in q.book.posts for q in peers for i in range(20))


def test_undrained_notifications_are_bounded_per_agent(agents):
    lim = limits.PeerLimits(max_agent_notes=6)
    d = agents("d", config=kvxfer.AgentConfig(limits=lim))
    a, b = agents("a", 1), agents("b", 2)
    peer_a, peer_b = a.connect(d.address), b.connect(d.address)
    for _ in range(4):
        peer_a.conn.send(encode(Msg.NOTIFY, data=b"a"))
    _until(lambda: d._conns.books.notes == 4, "a's notifications")
    for _ in range(4):
        peer_b.conn.send(encode(Msg.NOTIFY, data=b"b"))
    _until(lambda: not peer_b.is_connected, "D to drop the peer past the agent's total")
    assert d._conns.books.notes == 6 and len(d.notifications()) == 6 and d._conns.books.notes == 0
    assert peer_a.is_connected


def test_staging_requests_are_bounded_per_agent_and_freed_with_their_peer():
    books = AgentBook(limits.PeerLimits(max_stage_reqs=2, max_agent_stage_reqs=3))
    a, b = books.open(1), books.open(2)
    a.add_stage_req()
    a.add_stage_req()
    b.add_stage_req()
    with pytest.raises(kvxfer.LimitExceeded, match="from all peers"):
        b.add_stage_req()
    assert (books.stage_reqs, b.stage_reqs) == (3, 1)
    a.close()  # disconnected: its grants are freed without a STAGE_RELEASE
    assert books.stage_reqs == 1 and books.books == {2: b}
    b.add_stage_req()
    b.end_stage_req()
    assert books.stage_reqs == 1
