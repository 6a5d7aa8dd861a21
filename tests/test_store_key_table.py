"""A store node's key table (kvxfer.store.key_table): it answers as the node's index does,
readers in other processes see a consistent bucket while the node writes, and same-host
clients answer lookups from it (without a request) only while it is current."""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest

import kvxfer
from kvxfer.store import index as ix
from kvxfer.store.key_table import ABSENT, PRESENT, UNKNOWN, KeyTable
from store_cases import SECRET, make_layout, start_node, stop_node
from waiting import until


def _table(nbuckets: int):
    buf = kvxfer.shared_empty(KeyTable.nbytes(nbuckets))
    table = KeyTable(buf.data_ptr(), nbuckets)
    table.init()
    return buf, table


def test_find_add_remove_overflow_and_bad_input():
    buf, t = _table(1)  # one bucket: the eighth key overflows
    keys = [bytes([i]) * (1 + i) for i in range(9)]
    for k in keys:
        t.add(k)
    assert t.num_overflows == 2
    got = t.find(keys + [b"absent"])
    assert list(got[:7]) == [PRESENT] * 7 and list(got[7:]) == [UNKNOWN] * 3  # a full bucket cannot tell
    for k in keys[:2]:  # ways free up, but the overflowed keys are still not in them
        t.remove(k)
    assert list(t.find(keys + [b"absent"])) == [UNKNOWN] * 2 + [PRESENT] * 5 + [UNKNOWN] * 3
    for k in keys[7:]:  # the overflowed keys leave: the bucket can tell again
        t.remove(k)
    assert list(t.find(keys + [b"absent"])) == [ABSENT] * 2 + [PRESENT] * 5 + [ABSENT] * 3
    with pytest.raises(ValueError):
        t.find([b""])
    with pytest.raises(ValueError):
        t.find([b"x" * 65])
    with pytest.raises(TypeError):
        t.find(["text"])
    with pytest.raises(ValueError):
        KeyTable(buf.data_ptr(), 3)
    assert t.is_fresh()
    t.beat(alive=False)
    assert not t.is_fresh()
    assert not KeyTable(buf.data_ptr(), 2).is_fresh()  # a header of another geometry is no table


def test_the_table_answers_as_the_index_does():
    """Random puts, gets, bad reads and evictions through a SlotIndex mirrored into a small
    table (some buckets overflow): every key reads PRESENT exactly when the index holds it,
    or UNKNOWN in a bucket that overflowed; never a wrong answer."""
    buf, t = _table(4)
    idx = ix.SlotIndex(48 * 64, 64, high_watermark=0.9, mirror=t)  # 48 chunks of 64 bytes
    rng = random.Random(5)
    universe = [rng.randbytes(rng.choice((8, 32, 64))) for _ in range(200)]
    pins, unknown = [], 0
    for step in range(3000):
        k = rng.choice(universe)
        op = rng.random()
        if op < 0.5:
            code, obj = idx.reserve(k, 64, "f", owner=1, now=step, lease_s=1e9)
            if code == ix.RESERVED and rng.random() < 0.9:
                idx.commit(k, obj.token, 0, 1)
            elif code == ix.RESERVED:
                idx.abort(k, obj.token, 1)
        elif op < 0.8:
            obj, pin = idx.get(k, "f", owner=2, now=step, lease_s=1e9)
            if obj is not None:
                pins.append(pin)
        elif pins:
            idx.release(pins.pop(rng.randrange(len(pins))), 2, bad=rng.random() < 0.3)
        if step % 100 == 0:
            got = t.find(universe)
            for key, code in zip(universe, got):
                if code == UNKNOWN:
                    unknown += 1
                else:
                    assert (code == PRESENT) == idx.contains(key), (step, key)
    assert idx.evictions > 0 and idx.bad > 0 and t.num_overflows > 0 and unknown > 0


def _churn(base: int, nbuckets: int, pair, stop_at: float) -> None:
    t = KeyTable(base, nbuckets)
    a, b = pair
    while time.monotonic() < stop_at:
        t.remove(a)
        t.add(b)
        t.remove(b)
        t.add(a)
    os._exit(0)


def test_keys_that_stay_read_present_while_their_bucket_churns():
    """One bucket: six keys that stay, and one way that a writer process turns from key A
    to key B and back as fast as it can. A reader in this process must see the six as
    present at every read, and A in both states."""
    buf, t = _table(1)
    fixed = [bytes([0x40 + i]) * 32 for i in range(6)]
    a, b = b"\x00" * 32, b"\xff" * 32
    for k in fixed + [a]:
        t.add(k)
    ctx = mp.get_context("fork")
    writer = ctx.Process(target=_churn, args=(t.base, 1, (a, b), time.monotonic() + 1.5))
    writer.start()
    try:
        seen = {PRESENT: 0, ABSENT: 0, UNKNOWN: 0}
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            got = t.find(fixed + [a])
            assert got[:6] == bytes([PRESENT]) * 6, got
            seen[got[6]] += 1
        assert seen[PRESENT] > 0 and seen[ABSENT] > 0 and seen[UNKNOWN] == 0  # the writer was changing the way
    finally:
        writer.join(timeout=30)
    assert writer.exitcode == 0


@pytest.fixture
def node_proc():
    proc, addr = start_node(capacity="4M", slot="64K")
    yield proc, addr
    stop_node(proc, signal.SIGKILL)


def test_same_host_lookups_read_the_table_while_it_is_current(node_proc):
    proc, addr = node_proc
    src = make_layout("2 N B H D", 16, seed=3)
    keys = kvxfer.block_keys(range(4 * 24), 4, salt=b"key-table")
    with kvxfer.KVStore(nodes=[addr], secret=SECRET) as st, \
            kvxfer.KVStore(nodes=[addr], secret=SECRET, backend="ucx") as remote:  # no vm path: asks
        st.put(keys[:16], src, range(16)).wait(timeout=60)
        assert st.lookup(keys) == 16 and remote.lookup(keys) == 16
        before = dict(st.stats()["client"])
        for n in (0, 1, 5, 16):  # each answered from the table alone
            assert st.lookup(keys[:n] + keys[16:]) == n
            assert st.lookup(keys[:n]) == n and remote.lookup(keys[:n]) == n
        after = st.stats()["client"]
        assert after["lookup_requests"] == before["lookup_requests"]
        assert after["lookup_table_reads"] >= before["lookup_table_reads"] + 7
        assert remote.stats()["client"]["lookup_table_reads"] == 0
        conn = st._conns[addr]
        assert conn.table is not None and remote._conns[addr].table is None

        os.kill(proc.pid, signal.SIGSTOP)  # a hung node: its table goes stale, lookups ask (and time out)
        try:
            until(lambda: not conn.table.is_fresh(), timeout=10)
            asked = st.counters["lookup_requests"]  # (stats() would ask the stopped node)
            st.timeout = 0.5
            assert st.lookup(keys) == 0
            assert st.counters["lookup_requests"] == asked + 1 and st.nodes() == {addr: "down"}
        finally:
            os.kill(proc.pid, signal.SIGCONT)


def test_a_node_that_closes_or_dies_is_not_read(node_proc):
    proc, addr = node_proc
    src = make_layout("2 N B H D", 8, seed=4)
    keys = kvxfer.block_keys(range(4 * 8), 4, salt=b"key-table-dead")
    with kvxfer.KVStore(nodes=[addr], secret=SECRET, retry_s=60.0) as st:
        st.put(keys, src, range(8)).wait(timeout=60)
        st.stats()  # queued behind the spares the put asks for after its handle is done: their reply is read
        assert st.lookup(keys) == 8 and st.stats()["client"]["lookup_table_reads"] >= 1
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # its table is still mapped here and its heartbeat recent, but its socket is closed:
        # the lookup asks, meets the dead node and marks it down
        assert st.lookup(keys) == 0
        assert st.nodes() == {addr: "down"} and st.stats()["client"]["node_failures"] == 1

    proc, addr = start_node(capacity="4M", slot="64K")
    try:
        with kvxfer.KVStore(nodes=[addr], secret=SECRET) as st:
            st.put(keys, src, range(8)).wait(timeout=60)
            assert st.lookup(keys) == 8
            table = st._conns[addr].table
            assert table.is_fresh()
            stop_node(proc, signal.SIGTERM)  # a node that closes clears its heartbeat at once
            assert not table.is_fresh()
            assert st.lookup(keys) == 0
    finally:
        stop_node(proc, signal.SIGKILL)
