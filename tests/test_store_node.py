"""A store node under bad luck and bad clients (the node runs in this process so the tests
can reach into its slots): corrupted slots, eviction while reads are in flight, a wrong
secret, garbage and oversize requests, a client that never reads its replies."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest
import torch

import kvxfer
from kvxfer import auth
from kvxfer.framing import HEADER, MAGIC, PROTOCOL_VERSION, encode_frame, parse_header
from kvxfer.agent.protocol import Msg, decode, encode as encode_msg
from kvxfer.store.conn import NodeConn, NodeError
from kvxfer.store.node import StoreNode
from kvxfer.store.objects import ObjectFormat
from kvxfer.store.protocol import MAX_KEYS, Req
from store_cases import SECRET, block_bits, fill_block, make_layout

SLOT = 1536  # one object of the store_cases model: 3 layers * 2 * 4 tokens * 4 heads * 8 * 2 B


@pytest.fixture
def node():
    n = StoreNode("127.0.0.1:0", 8 * SLOT, secret=SECRET, slot_bytes=SLOT, high_watermark=1.0,
                  max_queued_bytes=64 << 10)
    yield n
    n.close()


def _store(node, **kw):
    return kvxfer.KVStore(nodes=[node.address], secret=SECRET, **kw)


@pytest.mark.parametrize("head_dim", [8, 128])  # through staging / zero-copy
def test_flipped_byte_in_a_slot_is_a_miss(head_dim):
    slot = 32 << 10
    node = StoreNode("127.0.0.1:0", 8 * slot, secret=SECRET, slot_bytes=slot)
    src = make_layout("2 N B H D", 6, seed=11, head_dim=head_dim)
    keys = kvxfer.block_keys(range(24), 4, salt=b"flip")
    try:
        with _store(node) as st:
            st.put(keys, src, range(6)).wait(timeout=60)
            obj = node.index.peek(keys[3])
            node.buffer[obj.offset + 100] ^= 0x10  # one bit of the fourth object
            dst = make_layout("N 2 B H D", 6, head_dim=head_dim)
            h = st.get(keys, dst, range(6))
            with pytest.raises(kvxfer.StoreMiss) as err:
                h.wait(timeout=60)
            assert err.value.loaded == 3
            for i in (0, 1, 2, 4, 5):
                assert torch.equal(block_bits(src, i), block_bits(dst, i))
            s = st.stats()
            assert s["client"]["checksum_failures"] == 1 and s["bad_objects"] == 1
            assert st.lookup(keys) == 3  # the node dropped it
            st.put(keys, src, range(6)).wait(timeout=60)  # and takes a good copy again
            assert st.lookup(keys) == 6
            st.get(keys, dst, range(6)).wait(timeout=60)
            assert torch.equal(block_bits(src, 3), block_bits(dst, 3))
    finally:
        node.close()


def test_eviction_never_frees_a_pinned_slot(node):
    """A reader's pin holds its slot through an eviction storm (the oldest objects, which
    LRU would take first): the bytes it reads after the storm are the object's."""
    src = make_layout("2 N B H D", 16)
    for b in range(16):
        fill_block(src, b, b)
    fmt = ObjectFormat(src)
    old = kvxfer.block_keys(range(8), 4, salt=b"old")
    with _store(node) as writer, _store(node) as flooder:
        writer.put(old, src, [0, 1]).wait(timeout=60)
        backend = kvxfer.transport.make_backend("auto")
        staging = kvxfer.shared_empty(2 * SLOT)
        region = backend.register_tensor(staging)
        c = NodeConn.open(node.address, SECRET, backend, 10.0)
        try:
            r = c.request(Req.GET, {"keys": old, "fmt": fmt.fmt}, 10.0)["r"]
            assert all(pin > 0 for *_, pin in r)
            for round_ in range(4):  # 4 x 8 new objects through 8 slots, two of them pinned
                keys = kvxfer.block_keys([round_ + 100] * 32, 4, salt=b"flood")
                flooder.put(keys, src, range(2, 10)).wait(timeout=60)
            assert node.index.evictions >= 12 and node.index.contains(old[0])  # pinned: it outlived them
            descs = np.array([(region, i * SLOT, c.region, off, nb) for i, (off, nb, _, _) in enumerate(r)],
                             dtype=np.int64)
            c.move("read", descs, 10.0)
            for i, b in enumerate((0, 1)):
                want = kvxfer.pack(src, [b], heads=fmt.heads)
                assert torch.equal(staging[i * SLOT:i * SLOT + fmt.nbytes], want)
            c.send(Req.RELEASE, {"pins": [p for *_, p in r], "bad": []}, reply=False)
        finally:
            c.close()
            backend.close()


def test_gets_racing_evictions_never_return_stale_kv(node):
    src = make_layout("2 N B H D", 24)
    for b in range(24):
        fill_block(src, b, b)
    chains = [kvxfer.block_keys([i] * 8, 4, salt=b"race") for i in range(6)]
    failures = []

    def flood():
        with _store(node) as st:
            for i in range(30):
                try:
                    st.put(chains[i % 6], src, [2 * (i % 6), 2 * (i % 6) + 1]).wait(timeout=60)
                except kvxfer.KVXferError as exc:  # a full node skips; nothing else may fail
                    failures.append(exc)

    t = threading.Thread(target=flood)
    t.start()
    with _store(node) as st:
        for i in range(40):
            c = i % 6
            dst = make_layout("N 2 H B D", 2)
            try:
                st.get(chains[c], dst, [0, 1]).wait(timeout=60)
                loaded = 2
            except kvxfer.StoreMiss as miss:
                loaded = miss.loaded
            for j in range(loaded):
                assert torch.equal(block_bits(dst, j), block_bits(src, 2 * c + j)), (i, j)
    t.join(120)
    assert not failures and not t.is_alive()
    assert node.index.evictions > 0


def test_wrong_secret_learns_nothing(node):
    with pytest.raises(kvxfer.AuthenticationError):
        with kvxfer.KVStore(nodes=[node.address], secret=b"w" * 32) as st:
            st.lookup([b"k"])
    # byte by byte: a wrong MAC gets a random nonce, then AUTH_FAIL, then the close
    host, port = node.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(encode_msg(Msg.HELLO, nonce=auth.AGENT_CHALLENGE.new_nonce()))
        s.sendall(encode_msg(Msg.AUTH, mac=b"\0" * 32))
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    kinds = []
    while got:
        t, n = parse_header(got[:HEADER.size])
        kinds.append(decode(t, got[HEADER.size:HEADER.size + n])[0])
        got = got[HEADER.size + n:]
    assert kinds == [Msg.CHALLENGE, Msg.AUTH_FAIL]
    st = node.stats()
    assert st["auth_failures"] == 2 and st["clients"] == 0


def _raw(c: NodeConn, msg_type: int, payload: bytes) -> None:
    c._sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, len(payload)) + payload)


def _reply(c: NodeConn) -> dict:
    c._sock.settimeout(10)
    t, n = parse_header(c._read(HEADER.size), 1 << 20)
    return json.loads(c._read(n))


def test_garbage_and_oversize_requests_fail_alone(node):
    src = make_layout("2 N B H D", 2, seed=12)
    keys = kvxfer.block_keys(range(8), 4, salt=b"garbage")
    backend = kvxfer.transport.make_backend("auto")
    c = NodeConn.open(node.address, SECRET, backend, 10.0)
    with _store(node) as good:
        good.put(keys, src, [0, 1]).wait(timeout=60)
        try:
            _raw(c, Req.LOOKUP, b"not json")
            assert _reply(c)["error"] == "bad_request"
            _raw(c, 99, json.dumps({"id": 5}).encode())
            assert _reply(c) == {"id": 5, "error": "bad_request", "reason": "unknown request type 99"}
            _raw(c, Req.LOOKUP, json.dumps({"id": 6, "keys": 65}).encode() + b"\0" + b"a" * 65)  # a 65-byte key
            assert _reply(c)["id"] == 6
            _raw(c, Req.LOOKUP, json.dumps({"id": 7, "keys": 1}).encode() + b"\0" + b"a" * (MAX_KEYS + 1))
            assert _reply(c)["error"] == "bad_request"
            _raw(c, Req.GET, json.dumps({"id": 8, "keys": 1, "fmt": "x", "extra": 1}).encode() + b"\0a")
            assert _reply(c)["error"] == "bad_request"
            _raw(c, Req.LOOKUP, json.dumps({"id": 9, "keys": [2, 2]}).encode() + b"\0aaa")  # lengths != bytes
            assert _reply(c) == {"id": 9, "error": "bad_request",
                                 "reason": "field 'keys': lengths do not add up to the bytes"}
            _raw(c, Req.LOOKUP, b"x" * (2 << 20))  # oversize: skipped unread, answered
            assert _reply(c)["error"] == "too_large"
            with pytest.raises(NodeError, match="too_large"):
                c.request(Req.RESERVE, {"keys": [b"k"], "nbytes": SLOT + 1, "fmt": "f"}, 10.0)
            # the same connection and every other client go on
            assert c.request(Req.LOOKUP, {"keys": keys}, 10.0)["present"] == "11"
            assert good.lookup(keys) == 2
            # a broken stream (bad magic) costs only that connection
            c._sock.sendall(b"XX" + b"\0" * 30)
            with pytest.raises(kvxfer.PeerDisconnected):
                c.recv(c.send(Req.STATS, {}), 10.0)
            assert good.lookup(keys) == 2
            assert node.stats()["bad_requests"] == 8
        finally:
            c.close()
            backend.close()


def test_a_client_that_never_reads_is_bounded(node):
    backend = kvxfer.transport.make_backend("auto")
    c = NodeConn.open(node.address, SECRET, backend, 10.0)
    try:
        frame = encode_frame(Req.STATS, b'{"id":1}')
        n = 2000  # ~1.2 MB of replies against a 64 KiB queue
        c._sock.sendall(frame * n)
        with _store(node) as other:  # the node still serves others meanwhile
            assert other.lookup([b"k"]) == 0
            assert node.stats()["queued_peak_bytes"] < (64 << 10) + 4096
        for _ in range(n):  # every reply comes, in order, once read
            assert _reply(c)["id"] == 1
    finally:
        c.close()
        backend.close()


def test_a_chain_longer_than_one_request():
    """More keys on one node than one request may name: several requests, one lock hold."""
    n = MAX_KEYS + 10
    node = StoreNode("127.0.0.1:0", (n + 64) * 64, secret=SECRET, slot_bytes=64, high_watermark=1.0)
    tiny = kvxfer.KVLayout.from_tensors([torch.zeros(2, n, 1, 1, 4, dtype=torch.float16)], "2 N B H D")
    keys = kvxfer.block_keys(range(n), 1, salt=b"long")
    got = []
    try:
        with _store(node) as st:
            st.put(keys, tiny, range(n)).wait(timeout=120)
            t = threading.Thread(target=lambda: got.append(st.lookup(keys)), daemon=True)
            t.start()
            t.join(60)
            assert got == [n]
    finally:
        node.close()


def _until(cond, timeout: float = 10.0) -> None:
    """Wait for ``cond()`` (a client asks for spares after its put's handle is done)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_spare_slots_carry_the_next_put_and_stay_their_clients():
    """After a put on the node's host the client keeps spare slots for its next put (as many
    as it wrote, at most 1/16 of the node's slots); that put writes into them and commits
    with one request. Another client naming those spares, or a forged token, commits
    nothing and leaves them their owner's; bad SPARE and COMMIT_SPARE requests fail alone."""
    with StoreNode("127.0.0.1:0", 64 * SLOT, secret=SECRET, slot_bytes=SLOT) as node:
        src, back = make_layout("2 N B H D", 8, seed=31), make_layout("2 N B H D", 8)
        keys = kvxfer.block_keys(range(32), 4, salt=b"spares")
        backend = kvxfer.transport.make_backend("auto")
        c = NodeConn.open(node.address, SECRET, backend, 10.0)
        try:
            with _store(node) as st:
                st.put(keys[:4], src, range(4)).wait(timeout=60)
                _until(lambda: node.stats()["spares"] == 4)  # kept for the next put: as many as it wrote
                spares = {o.token: o.offset for o in node.index._spares.values()}
                # another client: the spares are not its to commit; forged tokens name nothing
                fmt = ObjectFormat(src)
                for token in [*spares, 123456789]:
                    r = c.request(Req.COMMIT_SPARE, {"keys": [keys[7]], "tokens": [token], "crcs": [0],
                                                     "nbytes": fmt.nbytes, "fmt": fmt.fmt}, 10.0)
                    assert r["r"] == [kvxfer.store.index.NO_SPARE]
                with pytest.raises(NodeError, match="too_large"):
                    c.request(Req.COMMIT_SPARE, {"keys": [keys[7]], "tokens": [1], "crcs": [0], "nbytes": SLOT + 1,
                                                 "fmt": "f"}, 10.0)
                for count, evict in ((0, True), (MAX_KEYS + 1, True), (True, True), ("4", True), (2, 1)):
                    with pytest.raises(NodeError, match="bad_request"):
                        c.request(Req.SPARE, {"count": count, "evict": evict, "nbytes": SLOT}, 10.0)
                assert len(c.request(Req.SPARE, {"count": 2, "evict": False, "nbytes": SLOT}, 10.0)["s"]) == 2
                assert not node.index.contains(keys[7]) and node.stats()["spares"] == 6
                # the next put goes into the spares the first one left (and keeps as many again)
                st.put(keys[4:8], src, range(4, 8)).wait(timeout=60)
                assert sorted(node.index.peek(k).offset for k in keys[4:8]) == sorted(spares.values())
                _until(lambda: node.stats()["spares"] == 6)
                assert st.stats()["client"]["put_objects"] == 8
                # a put of present keys writes nothing: it refreshes them, and the spares stay
                st.put(keys[:2], src, range(2)).wait(timeout=60)
                assert st.stats()["client"]["put_present"] == 2 and node.stats()["spares"] == 6
                st.get(keys[:8], back, range(8)).wait(timeout=60)
                for b in range(8):
                    assert torch.equal(block_bits(back, b), block_bits(src, b))
                assert c.request(Req.LOOKUP, {"keys": keys[:8]}, 10.0)["present"] == "1" * 8
            _until(lambda: node.stats()["spares"] == 2)  # the store's went with its connection; c's stay
        finally:
            c.close()
            backend.close()


class _NodeWithoutSpares(StoreNode):
    """A node that answers SPARE and COMMIT_SPARE as a node without them does."""

    def _serve(self, c, msg_type, payload, now):
        if msg_type in (Req.SPARE, Req.COMMIT_SPARE):
            rid = json.loads(bytes(payload).split(b"\0")[0]).get("id")
            return {"id": rid, "error": "bad_request", "reason": f"unknown request type {msg_type}"}
        return super()._serve(c, msg_type, payload, now)


def test_a_node_without_spare_slots_gets_reserve_and_commit():
    with _NodeWithoutSpares("127.0.0.1:0", 64 * SLOT, secret=SECRET, slot_bytes=SLOT) as node:
        src, back = make_layout("2 N B H D", 4, seed=41), make_layout("2 N B H D", 4)
        keys = kvxfer.block_keys(range(16), 4, salt=b"no-spares")
        with _store(node) as st:
            st.put(keys[:2], src, [0, 1]).wait(timeout=60)  # refused SPARE: reserve and commit
            st.put(keys[2:], src, [2, 3]).wait(timeout=60)  # and no SPARE asked again
            st.get(keys, back, range(4)).wait(timeout=60)
            for b in range(4):
                assert torch.equal(block_bits(back, b), block_bits(src, b))
            assert st.stats()["client"]["put_objects"] == 4 and node.stats()["spares"] == 0
            assert not st._conns[node.address].spare_slots


class _NodeWithBadSpares(StoreNode):
    """A node whose spares lie past its slots once ``lie`` is set."""

    lie = False

    def _serve(self, c, msg_type, payload, now):
        reply = super()._serve(c, msg_type, payload, now)
        if msg_type == Req.SPARE and self.lie:
            reply["s"] = [[self.index.region_bytes, tok] for _, tok in reply["s"]]
        return reply


def test_a_spare_outside_the_nodes_slots_marks_it_down():
    with _NodeWithBadSpares("127.0.0.1:0", 64 * SLOT, secret=SECRET, slot_bytes=SLOT) as node:
        src = make_layout("2 N B H D", 4, seed=51)
        keys = kvxfer.block_keys(range(32), 4, salt=b"bad-spares")
        with _store(node, retry_s=60.0) as st:
            st.put(keys[:4], src, range(4)).wait(timeout=60)
            _until(lambda: node.stats()["spares"] == 4)  # refilled, truthfully
            node.lie = True
            st.put(keys[4:], src, range(4)).wait(timeout=60)  # into the spares it held: done
            _until(lambda: st.nodes()[node.address] == "down")  # the refill's were outside the slots
            assert st.stats()["client"]["node_failures"] == 1 and node.index.contains(keys[0])


def test_spares_asked_for_after_a_put_never_evict():
    """A full node: a put evicts for the slots it needs now, but the spares its client asks
    for afterwards take free slots only, so they cost no object."""
    with StoreNode("127.0.0.1:0", 64 * SLOT, secret=SECRET, slot_bytes=SLOT, high_watermark=1.0) as node:
        src = make_layout("2 N B H D", 64, seed=61)
        keys = kvxfer.block_keys(range(68 * 4), 4, salt=b"full")
        with _store(node) as filler:
            filler.put(keys[:64], src, range(64)).wait(timeout=60)
        _until(lambda: node.stats()["spares"] == 0)  # (the filler's went with it)
        assert len(node.index) == 64 and node.index.evictions == 0
        with _store(node) as st:
            st.put(keys[64:], src, range(4)).wait(timeout=60)
            st.get(keys[64:65], src, [4]).wait(timeout=60)  # queued behind the client's ask for spares
            assert node.index.evictions == 4 and len(node.index) == 64 and node.stats()["spares"] == 0
