"""Multi-part puts: the ranks of a TP group each put their heads of the same keys; the
object is readable once every head is in, bitwise what a tp=1 writer would have stored,
in any layout and TP degree. Faults: a rank that never finishes, a flipped byte in one
part, overlapping parts, forged head ranges."""
from __future__ import annotations

import json
import signal
import time

import pytest
import torch

import kvxfer
from kvxfer.store.conn import NodeConn, NodeError
from kvxfer.store.node import StoreNode
from kvxfer.store.objects import ObjectFormat
from kvxfer.store.protocol import MAX_HEADS, Req
from store_cases import H, SECRET, block_bits, make_layout, start_node, stop_node

SLOT = 64 << 10


def tp_ranks(src, dims: str, tp_size: int, *, ranks=None, head_dim: int):
    """The ``tp_size`` ranks' pools (``dims``) holding ``src``'s blocks, each its own heads."""
    out = []
    for r in (range(tp_size) if ranks is None else ranks):
        part = make_layout(dims, src.num_blocks, tp_rank=r, tp_size=tp_size, head_dim=head_dim)
        lo, hi = part.head_range
        for l in range(src.num_layers):
            for kv in range(2):
                part.kv_view(l, kv).copy_(src.kv_view(l, kv)[:, :, lo:hi])
        out.append(part)
    return out


def _store(address: str, **kw):
    return kvxfer.KVStore(nodes=[address], secret=SECRET, **kw)


LEASE_S = 2.0  # the reservation lease of the node that sees a rank die


@pytest.fixture(scope="module")
def node():
    proc, addr = start_node(slot="128K")
    yield addr
    assert stop_node(proc, signal.SIGTERM) == 0


@pytest.fixture(scope="module")
def short_lease_node():
    proc, addr = start_node(slot="128K", extra=["--lease", str(LEASE_S)])
    yield addr
    assert stop_node(proc, signal.SIGTERM) == 0


@pytest.mark.parametrize("dims,head_dim", [("N 2 B H D", 8), ("N 2 B H D", 128), ("N 2 H B D", 128)])
def test_two_ranks_put_halves_a_tp1_reader_gets_the_whole(node, dims, head_dim):
    """NHD ranks write straight from their blocks (one descriptor per row of the
    object), HND ranks through staging; readers: HND through staging, a tp=2 NHD rank."""
    src = make_layout("2 N B H D", 6, seed=21, head_dim=head_dim)
    ranks = tp_ranks(src, dims, 2, head_dim=head_dim)
    assert ObjectFormat(ranks[0]).put_zero_copy == (dims == "N 2 B H D")
    keys = kvxfer.block_keys(range(5 * 4), 4, salt=b"tp-put-%s-%d" % (dims.encode(), head_dim))
    ids = [4, 0, 5, 2, 3]
    with _store(node) as r0, _store(node) as r1, _store(node) as reader:
        h = r0.put(keys, ranks[0], ids)
        h.wait(timeout=60)
        assert h.nbytes == 5 * ranks[0].wire_nbytes(1)  # its heads only
        # rank 1 has not put yet: the objects are not there for anyone
        assert reader.lookup(keys) == 0 and r0.lookup(keys) == 0
        dst = make_layout("N 2 H B D", 6, head_dim=head_dim)  # tp=1, HND
        with pytest.raises(kvxfer.StoreMiss) as miss:
            reader.get(keys, dst, [0, 1, 2, 3, 4]).wait(timeout=60)
        assert miss.value.loaded == 0
        r1.put(keys, ranks[1], ids).wait(timeout=60)
        assert reader.lookup(keys) == 5
        reader.get(keys, dst, [5, 1, 0, 3, 2]).wait(timeout=60)
        for s, d in zip(ids, [5, 1, 0, 3, 2]):
            assert torch.equal(block_bits(src, s), block_bits(dst, d))
        # a tp=2 reader in another layout gets its half of the same objects
        half = make_layout("2 N B H D", 6, tp_rank=1, tp_size=2, head_dim=head_dim)
        reader.get(keys, half, [0, 1, 2, 3, 4]).wait(timeout=60)
        lo, hi = half.head_range
        for s, d in zip(ids, range(5)):
            assert torch.equal(block_bits(src, s)[:, :, :, lo:hi], block_bits(half, d))
        # present now: a put by either rank, or by a tp=1 writer, is a no-op
        for st, layout in ((r0, ranks[0]), (r1, ranks[1]), (reader, src)):
            before = st.stats()["client"]["put_present"]
            st.put(keys, layout, ids).wait(timeout=60)
            assert st.stats()["client"]["put_present"] == before + 5


def test_a_rank_that_never_finishes_leaves_nothing(short_lease_node):
    """A half-written object lapses whole with its lease and frees its slot; a rank that
    reserves and drops its connection takes the object with it at once."""
    node = short_lease_node
    src = make_layout("2 N B H D", 4, seed=22)
    r0, r1 = tp_ranks(src, "N 2 B H D", 2, head_dim=8)
    keys = kvxfer.block_keys(range(3 * 4), 4, salt=b"tp-put-dies")
    with _store(node) as st0, _store(node) as st1:
        base = st0.stats()["per_node"][node]["slots_used"]
        st0.put(keys, r0, [0, 1, 2]).wait(timeout=60)
        s = st0.stats()["per_node"][node]
        assert s["pending"] == 3 and s["slots_used"] == base + 3
        deadline = time.monotonic() + 20
        while st0.stats()["pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
        s = st0.stats()["per_node"][node]
        assert s["pending"] == 0 and s["slots_used"] == base and st0.lookup(keys) == 0
        st1.put(keys, r1, [0, 1, 2]).wait(timeout=60)  # the lapsed half does not come back
        assert st1.lookup(keys) == 0
        st0.put(keys, r0, [0, 1, 2]).wait(timeout=60)
        assert st1.lookup(keys) == 3
        out = make_layout("2 N B H D", 4)
        st1.get(keys, out, [3, 2, 1]).wait(timeout=60)
        for s_, d in zip([0, 1, 2], [3, 2, 1]):
            assert torch.equal(block_bits(src, s_), block_bits(out, d))
    # a rank that reserved its part and went away (connection dropped, nothing written)
    more = kvxfer.block_keys(range(100, 108), 4, salt=b"tp-put-dies")
    fmt = ObjectFormat(r1)
    with _store(node) as st0:
        st0.put(more, r0, [0, 1]).wait(timeout=60)
        backend = kvxfer.transport.make_backend("auto")
        c = NodeConn.open(node, SECRET, backend, 10.0)
        try:
            r = c.request(Req.RESERVE_PART, {"keys": more, "nbytes": fmt.nbytes, "fmt": fmt.fmt,
                                             "heads": [2, 4, 4]}, 10.0)["r"]
            assert [code for code, *_ in r] == [1, 1]  # RESERVED: joined rank 0's objects
        finally:
            c.close()
            backend.close()
        deadline = time.monotonic() + LEASE_S * 0.6  # inside the lease: the departure did it
        while st0.stats()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st0.stats()["pending"] == 0 and st0.lookup(more) == 0


@pytest.fixture
def local_node():
    n = StoreNode("127.0.0.1:0", 16 * SLOT, secret=SECRET, slot_bytes=SLOT, high_watermark=1.0)
    yield n
    n.close()


def test_slot_holds_the_tp1_bytes_and_a_flipped_byte_in_one_part_is_a_miss(local_node):
    src = make_layout("2 N B H D", 4, seed=23, head_dim=128)
    ranks = tp_ranks(src, "N 2 B H D", 2, head_dim=128)
    fmt = ObjectFormat(src)
    keys = kvxfer.block_keys(range(4 * 4), 4, salt=b"tp-put-flip")
    with _store(local_node.address) as s0, _store(local_node.address) as s1:
        s0.put(keys, ranks[0], range(4)).wait(timeout=60)
        s1.put(keys, ranks[1], range(4)).wait(timeout=60)
        for b, k in enumerate(keys):  # bitwise what a tp=1 writer stores: pack of every head
            obj = local_node.index.peek(k)
            assert len(obj.crc) == 2 and [p[:2] for p in obj.crc] == [[0, 2], [2, 4]]
            got = local_node.buffer[obj.offset:obj.offset + fmt.nbytes]
            assert torch.equal(got, kvxfer.pack(src, [b], heads=(0, H)))
        # one bit of rank 1's heads of the third object (row 5 of its rows, 3 bytes in)
        obj = local_node.index.peek(keys[2])
        local_node.buffer[obj.offset + 5 * fmt.row_bytes + 2 * fmt.head_bytes + 3] ^= 0x04
        for reader in ("N 2 B H D", "N 2 H B D"):  # zero-copy and staging readers
            dst = make_layout(reader, 4, head_dim=128)
            with pytest.raises(kvxfer.StoreMiss) as err:
                s0.get(keys, dst, range(4)).wait(timeout=60)
            assert err.value.loaded == 2
            for i in (0, 1, 3):
                assert torch.equal(block_bits(src, i), block_bits(dst, i))
            if reader == "N 2 B H D":
                assert s0.stats()["bad_objects"] == 1 and s0.lookup(keys) == 2  # the node dropped it
        for st, layout in ((s0, ranks[0]), (s1, ranks[1])):  # and takes good parts again
            st.put(keys, layout, range(4)).wait(timeout=60)
        dst = make_layout("N 2 H B D", 4, head_dim=128)
        s1.get(keys, dst, range(4)).wait(timeout=60)
        for i in range(4):
            assert torch.equal(block_bits(src, i), block_bits(dst, i))


def test_overlapping_parts_are_refused_other_splits_compose(local_node):
    src = make_layout("2 N B H D", 3, seed=24)
    keys = kvxfer.block_keys(range(3 * 4), 4, salt=b"tp-put-overlap")
    (a0,) = tp_ranks(src, "N 2 B H D", 2, ranks=[0], head_dim=8)  # heads 0-1
    q1, q2, q3 = tp_ranks(src, "N 2 B H D", 4, ranks=[1, 2, 3], head_dim=8)  # heads 1, 2, 3
    addr = local_node.address
    with _store(addr) as s_a, _store(addr) as s_b, _store(addr) as s_c:
        s_a.put(keys, a0, range(3)).wait(timeout=60)
        with pytest.raises(kvxfer.StorePartConflict) as err:  # head 1 is rank a0's already
            s_b.put(keys, q1, range(3)).wait(timeout=60)
        assert err.value.keys == keys and s_b.stats()["client"]["put_conflicts"] == 3
        before = s_c.stats()["client"]["put_skipped"]
        s_c.put(keys, a0, range(3)).wait(timeout=60)  # the same heads again (another group): skipped
        s_c.put(keys, src, range(3)).wait(timeout=60)  # a whole put while parts are written: skipped
        assert s_c.stats()["client"]["put_skipped"] == before + 6 and s_c.lookup(keys) == 0
        s_b.put(keys, q2, range(3)).wait(timeout=60)  # a tp=4 group's heads 2 and 3 complete it
        assert s_b.lookup(keys) == 0
        s_c.put(keys, q3, range(3)).wait(timeout=60)
        assert s_c.lookup(keys) == 3 and [p[:2] for p in local_node.index.peek(keys[0]).crc] == [[0, 2], [2, 3],
                                                                                                  [3, 4]]
        dst = make_layout("N 2 H B D", 3)
        s_a.get(keys, dst, range(3)).wait(timeout=60)
        for i in range(3):
            assert torch.equal(block_bits(src, i), block_bits(dst, i))


def test_forged_part_ranges_fail_that_request_only(local_node):
    fmt = ObjectFormat(make_layout("N 2 B H D", 2, tp_rank=0, tp_size=2))
    keys = kvxfer.block_keys(range(8), 4, salt=b"tp-put-forged")
    backend = kvxfer.transport.make_backend("auto")
    c = NodeConn.open(local_node.address, SECRET, backend, 10.0)
    try:
        def reserve(heads, nbytes=fmt.nbytes):
            return c.request(Req.RESERVE_PART, {"keys": keys, "nbytes": nbytes, "fmt": fmt.fmt, "heads": heads},
                             10.0)["r"]

        for heads in ([2, 1, 4], [0, 5, 4], [0, 0, 4], [-1, 1, 4], [0, 1, MAX_HEADS + 1], [0, 1], [0, 1.5, 4],
                      [True, 2, 4], "0-2", None):
            with pytest.raises(NodeError, match="bad_request"):
                reserve(heads)
        with pytest.raises(NodeError, match="too_large"):
            reserve([0, 2, 4], nbytes=SLOT + 1)
        assert local_node.stats()["pending"] == 0
        assert [code for code, *_ in reserve([0, 2, 4])] == [1, 1]  # the same connection goes on
        assert [code for code, *_ in reserve([1, 3, 4])] == [5, 5]  # CONFLICT: overlaps its own part
        assert [code for code, *_ in reserve([2, 4, 8])] == [5, 5]  # another head count
        with pytest.raises(NodeError, match="bad_request"):  # another size than the format names
            reserve([2, 4, 4], nbytes=fmt.nbytes - 2)
        # a commit quoting another token, or a checksum list, is refused / malformed
        assert c.request(Req.COMMIT, {"keys": keys, "tokens": [99999, 99998], "crcs": [1, 2]}, 10.0)["ok"] == [
            False, False]
        c._sock.sendall(_frame(Req.COMMIT, {"id": 77, "keys": 32, "tokens": [1, 2], "crcs": [[0, 2, 1], 2]}, keys))
        assert json.loads(_reply_payload(c))["error"] == "bad_request"
        assert local_node.stats()["pending"] == 2 and local_node.stats()["bad_requests"] == 13
    finally:
        c.close()
        backend.close()
    deadline = time.monotonic() + 5
    while local_node.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local_node.stats()["pending"] == 0 and local_node.index.slots_used == 0


def _frame(msg_type, obj, keys) -> bytes:
    from kvxfer.framing import HEADER, MAGIC, PROTOCOL_VERSION

    payload = json.dumps(obj).encode() + b"\0" + b"".join(keys)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg_type), len(payload)) + payload


def _reply_payload(c) -> bytes:
    from kvxfer.framing import HEADER, parse_header

    c._sock.settimeout(10)
    _, n = parse_header(c._read(HEADER.size), 1 << 20)
    return c._read(n)


def test_a_get_reply_holds_a_bounded_number_of_part_checksums(local_node, monkeypatch):
    """Objects past the reply's checksum budget miss (the reply always fits a frame);
    the worst reply under the real budget is checked against the frame limit."""
    from kvxfer.store import requests as handlers
    from kvxfer.store.protocol import MAX_KEYS, MAX_REQUEST_BYTES, REPLY, encode

    worst = {"id": 2**62, "r": [[2**40, 2**21, [[MAX_HEADS - 1, MAX_HEADS, 2**64 - 1]] * 4, 2**63 - 1]] * MAX_KEYS}
    assert handlers.MAX_REPLY_PARTS == 4 * MAX_KEYS
    assert len(encode(REPLY, worst)) < MAX_REQUEST_BYTES
    src = make_layout("2 N B H D", 3, seed=25)
    keys = kvxfer.block_keys(range(3 * 4), 4, salt=b"tp-put-budget")
    with _store(local_node.address) as st:
        for r in tp_ranks(src, "N 2 B H D", 4, head_dim=8):  # 4 parts an object
            st.put(keys, r, range(3)).wait(timeout=60)
        assert st.lookup(keys) == 3
        monkeypatch.setattr(handlers, "MAX_REPLY_PARTS", 10)
        dst = make_layout("N 2 H B D", 3)
        with pytest.raises(kvxfer.StoreMiss) as err:
            st.get(keys, dst, range(3)).wait(timeout=60)
        assert err.value.loaded == 2 and st.stats()["pins"] == 0  # after the RELEASE, on one connection
        monkeypatch.setattr(handlers, "MAX_REPLY_PARTS", 16384)
        st.get(keys, dst, range(3)).wait(timeout=60)
        for i in range(3):
            assert torch.equal(block_bits(src, i), block_bits(dst, i))
