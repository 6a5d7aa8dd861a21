"""Store nodes in their own processes dying and coming back: a SIGKILLed node fails only
the requests that need it (promptly, with a typed error), a restarted empty node is
used again, and nodes found through etcd."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import etcd_server
import kvxfer
from kvxfer.store.placement import owners
from serving_server import free_port
from store_cases import SECRET, block_bits, fill_block, make_layout, start_node, stop_node
from waiting import until


@pytest.fixture
def two_nodes():
    procs = [start_node(port=free_port()) for _ in range(2)]
    yield procs
    for p, _ in procs:
        stop_node(p, signal.SIGKILL)


def _chain_split(addrs, n=32):
    """Keys of one chain and which of them each node owns."""
    keys = kvxfer.block_keys(range(4 * n), 4, salt=b"faults")
    mine = {a: [i for i, k in enumerate(keys) if owners(addrs, k)[0] == a] for a in addrs}
    assert all(mine.values()), "each node must own part of the chain"
    return keys, mine


def test_node_killed_mid_get_fails_that_get_only_then_restarts_empty(two_nodes):
    (pa, a), (pb, b) = two_nodes
    keys, mine = _chain_split([a, b])
    src = make_layout("2 N B H D", 32)
    for i in range(32):
        fill_block(src, i, i)
    with kvxfer.KVStore(nodes=[a, b], secret=SECRET, timeout=5.0, retry_s=0.5) as st:
        st.put(keys, src, range(32)).wait(timeout=60)
        assert st.lookup(keys) == 32
        # gets in flight while node a dies: each ends (no hang), loaded or with a typed error
        results, stop = [], threading.Event()

        def getter():
            while not stop.is_set() and len(results) < 500:
                dst = make_layout("N 2 H B D", 32)
                h = st.get(keys, dst, range(32))
                try:
                    h.wait(timeout=60)
                    loaded = 32
                except (kvxfer.StoreMiss, kvxfer.PeerDisconnected, kvxfer.TransferTimeout) as exc:
                    assert h.done(), "the get hung"
                    loaded = getattr(exc, "loaded", 0)
                results.append(h.state)
                for i in range(loaded):
                    assert torch.equal(block_bits(dst, i), block_bits(src, i))

        t = threading.Thread(target=getter)
        t.start()
        until(lambda: len(results) >= 2, "gets before the kill", timeout=60)
        os.killpg(pa.pid, signal.SIGKILL)
        pa.wait(timeout=30)
        until(lambda: results.count("failed") >= 3 or not t.is_alive(), "failed gets after the kill", timeout=120)
        stop.set()
        t.join(120)
        assert not t.is_alive() and results.count("failed") >= 3  # a getter assertion would stop it early
        # now: a's keys are misses, b's still load
        first_a = mine[a][0]
        assert st.lookup(keys) == first_a
        only_b = [keys[i] for i in mine[b]]
        dst = make_layout("N 2 H B D", 32)
        st.get(only_b, dst, range(len(only_b))).wait(timeout=60)
        for j, i in enumerate(mine[b]):
            assert torch.equal(block_bits(dst, j), block_bits(src, i))
        assert st.nodes()[a] == "down" or st.stats()["nodes_down"] == 1
        # a comes back on its address, empty: the client tries it again after retry_s
        pa2, _ = start_node(port=int(a.rsplit(":", 1)[1]))
        try:
            until(lambda: st.stats()["nodes"] == 2, "the restarted node in use", timeout=60)
            assert st.lookup(keys) == first_a  # its objects are gone, nothing else
            st.put(keys, src, range(32)).wait(timeout=60)
            assert st.lookup(keys) == 32
            dst = make_layout("N 2 H B D", 32)
            st.get(keys, dst, range(32)).wait(timeout=60)
            assert torch.equal(block_bits(dst, first_a), block_bits(src, first_a))
        finally:
            stop_node(pa2, signal.SIGKILL)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    reason = etcd_server.unavailable()
    if reason:
        pytest.skip(reason)
    with etcd_server.local_etcd(str(tmp_path_factory.mktemp("etcd"))) as url:
        yield url


def test_nodes_found_through_etcd_and_withdrawn_on_sigterm(etcd):
    url = etcd + "/storetest"
    procs = [start_node(extra=("--discovery", url, "--ttl", "3")) for _ in range(2)]
    try:
        addrs = sorted(a for _, a in procs)
        with kvxfer.KVStore(discovery=url, secret=SECRET) as st:
            until(lambda: sorted(st.nodes()) == addrs, "both nodes in discovery", timeout=60)
            src = make_layout("2 N B H D", 8, seed=21)
            keys = kvxfer.block_keys(range(32), 4, salt=b"etcd")
            st.put(keys, src, range(8)).wait(timeout=60)
            assert st.lookup(keys) == 8 and st.stats()["nodes"] == 2
            # routers' members under the same prefix do not see store nodes
            from kvxfer.discovery import open_discovery
            assert open_discovery(url).members() == []
            assert stop_node(procs[0][0], signal.SIGTERM) == 0  # withdraws its record
            until(lambda: sorted(st.nodes()) == [procs[1][1]], "the stopped node withdrawn", timeout=60)
    finally:
        for p, _ in procs:
            stop_node(p, signal.SIGKILL)


def test_replicas_survive_a_dead_node(two_nodes):
    (pa, a), (pb, b) = two_nodes
    src = make_layout("2 N B H D", 16, seed=31)
    keys = kvxfer.block_keys(range(64), 4, salt=b"replicas")
    with kvxfer.KVStore(nodes=[a, b], secret=SECRET, replicas=2, timeout=5.0, retry_s=60.0) as st:
        st.put(keys, src, range(16)).wait(timeout=60)
        per_node = st.stats()["per_node"]
        assert per_node[a]["objects"] == per_node[b]["objects"] == 16  # every object on both
        os.killpg(pa.pid, signal.SIGKILL)
        pa.wait(timeout=30)
        first = st.lookup(keys)  # may meet the dead node once, then it is down
        assert first in (16, *[i for i, k in enumerate(keys) if owners([a, b], k)[0] == a][:1])
        assert st.lookup(keys) == 16
        dst = make_layout("N 2 H B D", 16)
        st.get(keys, dst, range(16)).wait(timeout=60)
        for i in range(16):
            assert torch.equal(block_bits(src, i), block_bits(dst, i))
