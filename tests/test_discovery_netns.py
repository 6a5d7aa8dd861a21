"""Serving across "hosts" found through etcd: namespaces as hosts (tests/netns.py).

etcd in one namespace, the router (``kvxfer serve --discovery``) in one, a
prefill and a decode worker (``kvxfer worker``) each in their own, joined by a
bridge. A chat request must give the tokens a colocated server gives; then the
decode worker is killed (out of rotation, requests answered, not hung) and a new
one started; then the router is restarted while the workers stay.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

import etcd_server
import netns
from serving_server import Server

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECRET = "netns-discovery-secret-0123456789"
CHAT = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5,
        "temperature": 0}
READY_S = 400.0  # model loads on a loaded 2-core machine
TTL_S = 3

HTTP = """
import json, sys, httpx
method, url, body = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    r = httpx.request(method, url, json=json.loads(body) if body else None, timeout=120)
    print(json.dumps({"status": r.status_code, "body": r.json()}))
except httpx.TransportError as exc:
    print(json.dumps({"status": 0, "body": str(exc)}))
"""


@pytest.fixture(scope="module")
def reference():
    server = Server("--colocated", "1")
    try:
        r = server.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        return r.json()["kvxfer"]["token_ids"]
    finally:
        server.stop()


@pytest.fixture
def hosts():
    for reason in (netns.unavailable(), etcd_server.unavailable()):
        if reason:
            pytest.skip(reason)
    with netns.Hosts(4) as four:
        yield four


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["KVXFER_SECRET"] = SECRET
    env["UCX_TLS"] = "tcp"
    return env


class Cluster:
    def __init__(self, hosts, tmp_path):
        self.etcd_host, self.router_host, self.p_host, self.d_host = hosts
        self.tmp = tmp_path
        self.url = f"etcd://{self.etcd_host.ip}:2379"
        self.base = f"http://{self.router_host.ip}:8000"

    def start(self, host, name: str, argv: list[str]):
        with open(self.tmp / f"{name}.log", "w") as log:
            return host.popen(argv, env=_env(), stdout=log, stderr=log, hostname=name)

    def kvxfer(self, host, name: str, argv: list[str]):
        return self.start(host, name, [sys.executable, "-m", "kvxfer.cli", *argv])

    def router(self, name: str = "router"):
        return self.kvxfer(self.router_host, name, [
            "serve", "--host", self.router_host.ip, "--port", "8000", "--discovery", self.url,
            "--log-level", "info"])

    def worker(self, role: str, name: str):
        host = self.p_host if role == "prefill" else self.d_host
        return self.kvxfer(host, name, [
            "worker", "--role", role, "--name", name, "--listen", f"{host.ip}:9000",
            "--discovery", self.url, "--ttl", str(TTL_S), "--threads", "1",
            "--num-blocks", "256", "--log-level", "info"])

    def http(self, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
        out = self.router_host.run([sys.executable, "-c", HTTP, method, self.base + path,
                                    json.dumps(body) if body else ""], timeout=180)
        reply = json.loads(out)
        return reply["status"], reply["body"]

    def wait_health(self, predicate, what: str, timeout: float = READY_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.http("GET", "/health")
            if status in (200, 503) and predicate(body):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not within {timeout:.0f}s: {body}")
            time.sleep(0.5)


def _alive(body: dict, name: str) -> bool:
    return any(w["name"] == name and w["alive"] for w in body["workers"])


def test_router_and_workers_on_separate_hosts_through_etcd(hosts, reference, tmp_path):
    c = Cluster(hosts, tmp_path)
    c.start(c.etcd_host, "etcd", etcd_server.etcd_command(c.etcd_host.ip, 2379, str(tmp_path / "etcd")))
    etcd_server.wait_ready(c.etcd_host.ip, 2379, run=lambda argv: c.router_host.run(argv, timeout=10))
    router = c.router()
    c.worker("prefill", "prefill-a")
    decode = c.worker("decode", "decode-a")
    c.wait_health(lambda b: b["status"] == "ok", "both workers connected")

    status, body = c.http("POST", "/v1/chat/completions", CHAT)
    assert status == 200, body
    assert body["kvxfer"]["token_ids"] == reference  # disaggregated across hosts == colocated
    assert body["kvxfer"]["kv_bytes"] > 0 and body["kvxfer"]["recomputed"] is False
    for host in hosts:  # nothing listens beyond each host's own address
        assert {addr for addr, _ in host.listening()} <= {host.ip}, (host, host.listening())

    # the decode worker dies: out of rotation, new requests answered at once (503), none hangs
    netns.stop(decode)
    c.wait_health(lambda b: not _alive(b, "decode-a"), "decode-a out of rotation", TTL_S + 30)
    status, body = c.http("POST", "/v1/chat/completions", CHAT)
    assert status == 503, body
    c.wait_health(lambda b: all(w["name"] != "decode-a" for w in b["workers"]),
                  "decode-a withdrawn (lease expiry)", TTL_S + 30)

    # a new decode worker joins at run time and gets traffic
    c.worker("decode", "decode-b")
    c.wait_health(lambda b: b["status"] == "ok" and _alive(b, "decode-b"), "decode-b joined")
    status, body = c.http("POST", "/v1/chat/completions", CHAT)
    assert status == 200 and body["kvxfer"]["decode_worker"] == "decode-b", body
    assert body["kvxfer"]["token_ids"] == reference

    # the router restarts; the workers stay (same processes) and are found again
    pids = {w["name"]: w["pid"] for w in c.http("GET", "/health")[1]["workers"]}
    netns.stop(router)
    c.router("router-2")
    health = c.wait_health(lambda b: b["status"] == "ok", "new router found the workers")
    assert {w["name"]: w["pid"] for w in health["workers"]} == pids
    status, body = c.http("POST", "/v1/chat/completions", CHAT)
    assert status == 200 and body["kvxfer"]["token_ids"] == reference, body

    _report_join_latency(tmp_path)


def _stamp(line: str) -> float:
    t = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
    return time.mktime(t) + int(line[20:23]) / 1e3


def _report_join_latency(tmp_path) -> None:
    """Worker published -> router connected, from the logs (printed, not asserted)."""
    published = [_stamp(x) for x in open(tmp_path / "decode-b.log") if "published decode-b" in x]
    connected = [_stamp(x) for x in open(tmp_path / "router.log")
                 if re.search(r"worker decode-b \(decode\) connected", x)]
    if published and connected:
        print(f"decode-b: published -> connected to the router {connected[0] - published[0]:.2f}s")
