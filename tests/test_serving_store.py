"""``kvxfer serve --store``: prefill workers read and fill a KV pool (real processes, HTTP).

One ``kvxfer store`` node with a disk tier; server A (1 prefill + 1 decode) serves a long
prompt cold (its prefill worker puts the prompt's full blocks into the pool), then again
from its own prefix cache (the reference: the tail computed over cached KV). The node
restarts (its DRAM written to disk at SIGTERM). A fresh server B serves the same prompt:
its prefill worker loads the blocks from the pool, read back from the node's disk tier
(``store_hit_tokens`` and ``store_disk_hit_tokens`` on ``/metrics``), computes only the tail, and answers
A's reference tokens exactly. Then the node is SIGKILLed: B recomputes a new prompt
(no hang) and answers what A answers cold for it.

With ``--routing kv`` the router looks each prompt up in the pool before it picks a
prefill worker, with the workers' own keys: the blocks a first request put are the
blocks the router sees for the second.
"""
from __future__ import annotations

import re
import signal
import time

import pytest
from serving_server import Server
from store_cases import SECRET, start_node, stop_node

pytestmark = pytest.mark.slow

BLOCK = 16  # the reference engine's block size
PROMPT = ("In a small village at the foot of the mountains, there lived an old clockmaker who "
          "repaired every clock in the valley. Each morning he walked to the square, wound the "
          "great tower clock, and listened to it strike the hour before opening his shop")
OTHER = "The lighthouse keeper counted the ships that passed the rocks each night, and wrote"
MAX_TOKENS = 6
ENV = {"KVXFER_SECRET": SECRET.decode()}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A node with a disk tier: ``{"proc", "addr", "disk"}`` (a test may restart it)."""
    disk = ("--disk", str(tmp_path_factory.mktemp("tier")), "--disk-capacity", "64M")
    proc, addr = start_node(capacity="64M", slot="1M", extra=disk)
    state = {"proc": proc, "addr": addr, "disk": disk}
    yield state
    stop_node(state["proc"])


def _server(addr) -> Server:
    return Server("--prefill", "1", "--decode", "1", "--matmul-dtype", "fp32", "--store", addr, env=ENV)


def _stat(server, stat: str, worker: str = "prefill-0") -> float:
    text = server.client.get("/metrics").text
    m = re.search(r'^kvxfer_worker_stat\{(?=[^}]*stat="%s")(?=[^}]*worker="%s")[^}]*\} (\S+)$'
                  % (re.escape(stat), re.escape(worker)), text, re.M)
    assert m, f"no kvxfer_worker_stat {stat} of {worker} on /metrics"
    return float(m.group(1))


def _tokens(resp) -> tuple:
    """``((text, logprobs), prompt tokens)``: the sampled tokens and their log-probabilities
    (``logprobs=0``), compared exactly."""
    choice = resp["choices"][0]
    return (choice["text"], choice["logprobs"]), resp["usage"]["prompt_tokens"]


def _pool_objects(addr) -> int:
    import kvxfer

    with kvxfer.KVStore(nodes=[addr], secret=SECRET, staging_bytes=1 << 12) as store:
        return store.stats()["objects"]


def _wait_for(pred, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.25)
    return pred()


def test_second_server_prefills_from_the_pool(node):
    addr = node["addr"]
    a = _server(addr)
    try:
        cold, n = _tokens(a.complete(PROMPT, max_tokens=MAX_TOKENS, logprobs=0))
        pooled = (n - 1) // BLOCK * BLOCK
        assert pooled >= 2 * BLOCK, n
        assert _wait_for(lambda: _pool_objects(addr) >= n // BLOCK), "A's blocks never reached the pool"
        assert _stat(a, "store_put_blocks") == n // BLOCK and _stat(a, "store_hit_tokens") == 0
        ref, _ = _tokens(a.complete(PROMPT, max_tokens=MAX_TOKENS, logprobs=0))  # from A's own prefix cache
        assert _stat(a, "store_local_hit_tokens") == pooled and _stat(a, "store_hit_tokens") == 0
        other_cold, _ = _tokens(a.complete(OTHER, max_tokens=MAX_TOKENS, logprobs=0))
    finally:
        a.stop()
    # the node restarts (SIGTERM writes DRAM to its disk tier): B loads the prompt from disk
    stop_node(node["proc"])
    node["proc"], _ = start_node(port=int(addr.rsplit(":", 1)[1]), capacity="64M", slot="1M", extra=node["disk"])
    b = _server(addr)
    try:
        got, _ = _tokens(b.complete(PROMPT, max_tokens=MAX_TOKENS, logprobs=0))
        assert got == ref
        assert _stat(b, "store_hit_tokens") == pooled and _stat(b, "store_local_hit_tokens") == 0
        assert _stat(b, "store_disk_hit_tokens") == pooled  # read back from the disk tier
        assert _stat(b, "store_lookups") == 1 and _stat(b, "store_load_failed") == 0
        # the node dies: B goes on serving, recomputing (OTHER is pooled, but unreachable now)
        stop_node(node["proc"], signal.SIGKILL)
        t0 = time.monotonic()
        again, _ = _tokens(b.complete(OTHER, max_tokens=MAX_TOKENS, logprobs=0))
        assert again == other_cold and time.monotonic() - t0 < 60.0
        assert _stat(b, "store_hit_tokens") == pooled
    finally:
        b.stop()


def test_the_kv_router_looks_prompts_up_in_the_pool():
    proc, addr = start_node(capacity="64M", slot="1M")  # its own: the test above kills its node
    srv = Server("--prefill", "2", "--decode", "1", "--matmul-dtype", "fp32", "--store", addr,
                 "--routing", "kv", env=ENV)
    try:
        prompt = PROMPT + " twice"
        _, n = _tokens(srv.complete(prompt, max_tokens=MAX_TOKENS))
        pooled = (n - 1) // BLOCK
        assert _wait_for(lambda: sum(_stat(srv, "store_put_blocks", w) for w in ("prefill-0", "prefill-1"))
                         == n // BLOCK)
        srv.complete(prompt, max_tokens=MAX_TOKENS)
        text = srv.client.get("/metrics").text
        m = re.search(r'^kvxfer_routed_blocks_total\{kind="pool",policy="kv",role="prefill"\} (\S+)$', text, re.M)
        # the router's keys are the workers' (same salt, same blocks): it saw every pooled block
        assert m and float(m.group(1)) == pooled, text
    finally:
        srv.stop()
        stop_node(proc)
