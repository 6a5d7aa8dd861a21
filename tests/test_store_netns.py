"""The KV store across "hosts" (network namespaces, tests/netns.py), found through etcd.

etcd on one host, two store nodes (``kvxfer store --discovery``) on two more, and engine
processes (``kvxfer.KVStore(discovery=...)``, tests/store_netns_engine.py) on two others,
joined by a bridge; data over UCX's TCP transport. Engine A puts a chain, engine B (its own
host) gets it bitwise into another layout; a store node is SIGKILLed: B's next get loads
the leading blocks that live on the other node and fails the rest with a typed error,
promptly; the node restarts empty and is found again.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

import etcd_server
import netns
from store_cases import SECRET, block_bits, make_layout

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SEED = 5


@pytest.fixture
def hosts():
    for reason in (netns.unavailable(), etcd_server.unavailable()):
        if reason:
            pytest.skip(reason)
    with netns.Hosts(5) as five:
        yield five


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["KVXFER_SECRET"] = SECRET.decode()
    env["UCX_TLS"] = "tcp"
    return env


def _node(host, url: str, log):
    return host.popen([sys.executable, "-m", "kvxfer.cli", "store", "--listen", f"{host.ip}:7600",
                       "--capacity", "16M", "--slot-size", "64K", "--discovery", url, "--ttl", "3",
                       "--log-level", "info"], env=_env(), stdout=log, stderr=log, hostname="store")


def _engine(host, url: str, nodes: int, op: str, *placed: str) -> dict:
    try:
        out = host.run([sys.executable, os.path.join(HERE, "store_netns_engine.py"), url, str(nodes), op,
                        str(SEED), *placed], timeout=240, env=_env())
    except subprocess.CalledProcessError as exc:
        raise AssertionError(f"engine {op} on {host} failed: {exc.stderr[-3000:]}") from None
    return json.loads(out.strip().splitlines()[-1])


def _expected() -> list:
    src = make_layout("2 N B H D", 16, seed=SEED, head_dim=128)
    return [hashlib.sha256(block_bits(src, i).numpy().tobytes()).hexdigest() for i in range(16)]


def test_store_nodes_and_engines_on_separate_hosts(hosts, tmp_path):
    etcd_host, s1, s2, eng_a, eng_b = hosts
    url = f"etcd://{etcd_host.ip}:2379/pool"
    with open(tmp_path / "etcd.log", "w") as log:
        etcd_host.popen(etcd_server.etcd_command(etcd_host.ip, 2379, str(tmp_path / "etcd")), stdout=log,
                        stderr=log)
    etcd_server.wait_ready(etcd_host.ip, 2379, run=lambda argv: eng_a.run(argv, timeout=10))
    logs = [open(tmp_path / f"store{i}.log", "w") for i in range(3)]
    try:
        node1 = _node(s1, url, logs[0])
        _node(s2, url, logs[1])

        put = _engine(eng_a, url, 2, "put")
        assert put["lookup"] == 16, put
        got = _engine(eng_b, url, 2, "get")
        assert got["error"] is None and got["sha"] == _expected(), got  # bitwise, NHD -> HND
        for host in (s1, s2):  # a store node listens on its own address only
            assert {addr for addr, _ in host.listening()} <= {host.ip}, (host, host.listening())

        netns.stop(node1)  # SIGKILL: its share of the chain is gone
        after = _engine(eng_b, url, 1, "get")
        loaded = after["loaded"]
        assert loaded < 16 and after["error"] in ("StoreMiss", "PeerDisconnected", "TransferTimeout"), after
        assert after["sha"] == _expected()[:loaded], after  # what loaded is right, the rest is a miss
        assert after["lookup"] == loaded, after
        print(f"get with one node dead: {loaded}/16 loaded, {after['error']} after {after['get_s']:.2f}s")
        every, live = f"{s1.ip}:7600,{s2.ip}:7600", f"{s2.ip}:7600"
        rest = _engine(eng_b, url, 1, "get-on", every, live)  # the live node's share still loads
        assert rest["blocks"] and rest["error"] is None, rest
        assert rest["sha"] == [_expected()[i] for i in rest["blocks"]], rest

        _node(s1, url, logs[2])  # back on its address, empty; found again through etcd
        again = _engine(eng_b, url, 2, "get")
        assert again["loaded"] == loaded and again["sha"] == _expected()[:loaded], again
        _engine(eng_a, url, 2, "put")
        full = _engine(eng_b, url, 2, "get")
        assert full["error"] is None and full["sha"] == _expected(), full
    finally:
        for log in logs:
            log.close()
