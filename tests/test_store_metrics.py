"""``kvxfer store --metrics``: a node's Prometheus counters and gauges, scraped over HTTP
from a real node process while a real client puts and gets."""
from __future__ import annotations

import re

import httpx
import pytest

import kvxfer
from store_cases import SECRET, make_layout, start_node, stop_node
from vllm_procs import free_port


def _scrape(url: str) -> dict:
    """``{(name, node label): value}`` of every kvxfer_store_* sample."""
    out = {}
    for line in httpx.get(url, timeout=10.0).text.splitlines():
        m = re.match(r'^(kvxfer_store_\w+)\{node="([^"]*)"\} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(3))
    return out


def test_node_metrics_follow_puts_gets_and_misses():
    port = free_port()
    proc, addr = start_node(capacity="4M", slot="64K", extra=("--metrics", f"127.0.0.1:{port}"))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        before = _scrape(url)
        assert before["kvxfer_store_capacity_bytes"] == 4 << 20 and before["kvxfer_store_num_slots"] == 64
        assert before["kvxfer_store_objects"] == 0 and before["kvxfer_store_hits_total"] == 0
        src, dst = make_layout("2 N B H D", 8, seed=3), make_layout("2 N B H D", 8)
        keys = kvxfer.block_keys(range(5 * 4), 4, salt=b"metrics")
        with kvxfer.KVStore(nodes=[addr], secret=SECRET) as store:
            store.put(keys[:4], src, [0, 1, 2, 3]).wait(30)
            store.get(keys[:3], dst, [4, 5, 6]).wait(30)
            with pytest.raises(kvxfer.StoreMiss):
                store.get(keys[3:], dst, [0, 1]).wait(30)  # keys[4] was never put
            stats = store.stats()
        after = _scrape(url)
        assert after["kvxfer_store_objects"] == 4 == stats["objects"]
        assert after["kvxfer_store_bytes_used"] == stats["bytes_used"] > 0
        assert after["kvxfer_store_hits_total"] == stats["hits"] >= 4
        assert after["kvxfer_store_misses_total"] == stats["misses"] >= 1
        assert after["kvxfer_store_evictions_total"] == 0 and after["kvxfer_store_pins"] == 0
        assert after["kvxfer_store_requests_total"] > before["kvxfer_store_requests_total"]
    finally:
        stop_node(proc)


def test_bad_metrics_address_is_refused():
    with pytest.raises(AssertionError, match="did not start"):
        start_node(extra=("--metrics", "no-port-here"), timeout=60.0)
