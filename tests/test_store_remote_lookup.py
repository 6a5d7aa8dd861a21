"""Lookups from other hosts: the node's backend answers them from its key table inside
UCX progress (csrc/remote_lookup.cpp), one message a node, no socket request; a key the
table cannot tell, or a peer that answers no lookups, falls back to the node's socket."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import kvxfer
from kvxfer._native import load
from kvxfer.errors import InvalidDescriptor, KVXferError
from kvxfer.transport import make_backend

import transport_peer
from store_cases import SECRET, make_layout, start_node, stop_node

TCP = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}
T = 30.0


@pytest.fixture
def tcp_env(monkeypatch):
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)  # read by UCX when an engine is created (the node inherits it)


def test_a_peer_that_serves_no_table_refuses_lookups_and_keeps_serving(tcp_env):
    b = make_backend("ucx")
    src = np.full(4096, 0x5A, np.uint8)
    try:
        with transport_peer.spawned(1 << 16, TCP) as (_, pipe, meta, rid):
            conn = b.connect(meta)
            assert conn.transport.startswith("ucx:tcp")
            with pytest.raises(InvalidDescriptor, match="no lookups"):
                b.wait(b.post_lookup(conn, [b"k" * 16, b"j"]), T)
            assert transport_peer.ask(pipe, "rejected", T) == 1
            for bad, err in (([], ValueError), ([b"k"] * 4097, ValueError), (["str"], TypeError),
                             ([b"x" * 65], ValueError), ([b""], ValueError)):
                with pytest.raises(err):
                    b.post_lookup(conn, bad)
            # the connection still moves bytes (and a write has no lookup result)
            write = b.post(conn, "write", [[b.register(src.ctypes.data, src.nbytes), 0, rid, 0, 4096]])
            b.wait(write, T)
            with pytest.raises(ValueError, match="no lookup on record"):
                b.lookup_result(write)
            pool = np.frombuffer(transport_peer.ask(pipe, "bytes", T), np.uint8)
            assert (pool[:4096] == 0x5A).all() and not pool[4096:].any()
    finally:
        b.close()


def _keys_in_one_bucket(nbuckets: int, n: int) -> list:
    """``n`` distinct keys whose key-table hashes pick bucket 0 of ``nbuckets``."""
    native, out, i = load(), [], 0
    while len(out) < n:
        k = b"bucket-zero-%d" % i
        if native.key_table_hash(k) & (nbuckets - 1) == 0:
            out.append(k)
        i += 1
    return out


def test_other_hosts_lookups_are_answered_by_the_nodes_backend(tcp_env):
    proc, addr = start_node(capacity="4M", slot="64K")  # 64 slots: a table of 64 buckets
    try:
        src = make_layout("2 N B H D", 16, seed=5)
        keys = kvxfer.block_keys(range(4 * 24), 4, salt=b"remote-lookup")
        with kvxfer.KVStore(nodes=[addr], secret=SECRET, backend="ucx", timeout=T) as st:
            st.put(keys[:16], src, range(16)).wait(timeout=60)
            assert st._conns[addr].bconn.transport.startswith("ucx:tcp") and st._conns[addr].table is None
            before = dict(st.counters)
            for n in (0, 1, 5, 16):
                assert st.lookup(keys[:n] + keys[16:]) == n
                assert st.lookup(keys[:n]) == n
            assert st.counters["lookup_requests"] == before["lookup_requests"]  # no socket request
            assert st.counters["lookup_backend_messages"] == before["lookup_backend_messages"] + 7
            assert st.stats()["per_node"][addr]["lookups_answered_by_backend"] >= 7
            # a chain longer than one message holds: two messages, both answers read
            long_chain = keys[:16] + [b"absent-%d" % i for i in range(5000)]
            sent = st.counters["lookup_backend_messages"]
            assert st.lookup(long_chain) == 16 and st.lookup(long_chain[:4097]) == 16
            assert st.counters["lookup_backend_messages"] == sent + 4

            # eight keys of one bucket: the eighth overflows it, and the table cannot tell
            # that bucket's misses; the node's index answers on its socket
            crowd = _keys_in_one_bucket(64, 8)
            small = make_layout("2 N B H D", 8, seed=6)
            for k in range(8):
                st.put(crowd[k:k + 1], small, [k]).wait(timeout=60)
            asked = st.counters["lookup_requests"]
            assert st.lookup(crowd) == 8
            assert st.counters["lookup_requests"] == asked + 1
            assert st.lookup(crowd[:7] + [b"absent-key"]) == 7  # ... and so is a miss there

            stop_node(proc, signal.SIGKILL)  # a dead node: its keys count as absent, nothing hangs
            st.timeout = 2.0
            assert st.lookup(keys[:16]) == 0
            assert st.nodes() == {addr: "down"}
    finally:
        stop_node(proc, signal.SIGKILL)


def test_lookups_over_a_same_host_vm_connection_read_the_mapped_table():
    proc, addr = start_node(capacity="4M", slot="64K")
    try:
        with kvxfer.KVStore(nodes=[addr], secret=SECRET, timeout=T) as st:
            st.lookup([b"k"])
            c = st._conns[addr]
            if c.bconn.transport != "vm":
                pytest.skip(f"no vm path here ({c.bconn.transport})")
            assert not c.remote_lookups
            with pytest.raises(KVXferError, match="mapped"):
                st._backend.post_lookup(c.bconn, [b"k"])
    finally:
        stop_node(proc, signal.SIGKILL)
