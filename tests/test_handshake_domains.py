"""One HMAC challenge (``kvxfer.auth.HmacChallenge``), two protocols: the agents' control
connections and the serving workers' router channel. Each proves the shared secret under
its own domain, so a proof made for one is refused by the other -- every test here would
pass a replayed proof if the two domains were equal. And the router channel keeps the
agents' pre-auth bounds: its whole handshake has a deadline, not each read."""
from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import pytest

import kvxfer
from kvxfer import Agent
from kvxfer.auth import AGENT_CHALLENGE, NONCE_BYTES, HmacChallenge
from kvxfer.agent.protocol import Msg, decode, encode as encode_msg
from kvxfer.config import PREAUTH_MAX_FRAME
from kvxfer.errors import AuthenticationError
from kvxfer.framing import HEADER, MAGIC, PROTOCOL_VERSION, read_frame, recv_frame
from kvxfer.serving.channel import ipc, netchannel
from kvxfer.serving.channel.netchannel import CHALLENGE as ROUTER_CHALLENGE
from kvxfer.serving.channel.netchannel import NetWorkerChannel, connect_worker

from floods import silent_flood

SECRET = b"domains-test-secret-0123456789ab"


def _address(chan) -> tuple[str, int]:
    host, port = chan.address.rsplit(":", 1)
    return host, int(port)


def test_domains_differ_and_nonces_have_one_length():
    assert AGENT_CHALLENGE.domain != ROUTER_CHALLENGE.domain
    assert not hasattr(kvxfer, "HmacChallenge")  # plumbing: kvxfer.auth, not the user API
    a, b = b"\x01" * NONCE_BYTES, b"\x02" * NONCE_BYTES
    proofs = {ch.client_mac(SECRET, a, b) for ch in (AGENT_CHALLENGE, ROUTER_CHALLENGE)}
    proofs |= {ch.server_mac(SECRET, b, a) for ch in (AGENT_CHALLENGE, ROUTER_CHALLENGE)}
    assert len(proofs) == 4  # neither protocol nor direction shares a proof
    with pytest.raises(ValueError):
        AGENT_CHALLENGE.client_mac(SECRET, a[:-1], b)
    with pytest.raises(TypeError):
        HmacChallenge(b"")


def _router_reply(sock, challenge: HmacChallenge) -> dict:
    """Answer the worker's hello with ``challenge``'s proof (right secret); the worker's reply."""
    hello = ipc.decode(*read_frame(sock, PREAUTH_MAX_FRAME))
    nonce_s, nonce_r = bytes.fromhex(hello["nonce"]), challenge.new_nonce()
    sock.sendall(ipc.encode({"nonce": nonce_r.hex(), "mac": challenge.client_mac(SECRET, nonce_s, nonce_r).hex()}))
    reply = ipc.decode(*read_frame(sock, PREAUTH_MAX_FRAME))
    if "mac" in reply:  # the worker proved itself: under the router channel's domain
        assert ROUTER_CHALLENGE.verify(ROUTER_CHALLENGE.server_mac(SECRET, nonce_r, nonce_s),
                                       bytes.fromhex(reply["mac"]))
    return reply


def test_an_agent_proof_is_refused_by_the_router_channel():
    chan = NetWorkerChannel("127.0.0.1:0", SECRET)
    try:
        with socket.create_connection(_address(chan), timeout=10) as sock:
            assert _router_reply(sock, AGENT_CHALLENGE) == {"auth": "refused"}
            assert read_frame(sock, PREAUTH_MAX_FRAME) is None  # closed, nothing more
        with socket.create_connection(_address(chan), timeout=10) as sock:  # the channel's own proof passes
            assert "mac" in _router_reply(sock, ROUTER_CHALLENGE)
    finally:
        chan.close()


def _agent_auth(address: str, challenge: HmacChallenge) -> Msg:
    """HELLO, then AUTH with ``challenge``'s proof (right secret); the kind of the agent's answer."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        nonce_c = challenge.new_nonce()
        sock.sendall(encode_msg(Msg.HELLO, nonce=nonce_c))
        kind, fields = decode(*recv_frame(sock, 10))
        assert kind == Msg.CHALLENGE
        nonce_s = fields["nonce"]
        sock.sendall(encode_msg(Msg.AUTH, mac=challenge.client_mac(SECRET, nonce_s, nonce_c)))
        kind, fields = decode(*recv_frame(sock, 10))
        if kind == Msg.AUTH_OK:  # the agent proved itself: under the agents' domain
            assert AGENT_CHALLENGE.verify(AGENT_CHALLENGE.server_mac(SECRET, nonce_c, nonce_s), fields["mac"])
        return kind


def test_a_router_proof_is_refused_by_an_agent():
    with Agent("a", secret=SECRET, backend="loopback") as agent:
        assert _agent_auth(agent.address, ROUTER_CHALLENGE) == Msg.AUTH_FAIL
        assert _agent_auth(agent.address, AGENT_CHALLENGE) == Msg.AUTH_OK  # the agents' own proof passes


def _fake_worker(server_challenge: HmacChallenge) -> tuple[socket.socket, threading.Thread]:
    """A listener that plays the worker's half, proving itself under ``server_challenge``."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = lsock.accept()
        with sock:
            nonce_s = server_challenge.new_nonce()
            sock.sendall(ipc.encode({"hello": netchannel.HELLO, "nonce": nonce_s.hex()}))
            reply = ipc.decode(*read_frame(sock, PREAUTH_MAX_FRAME))
            nonce_r = bytes.fromhex(reply["nonce"])
            sock.sendall(ipc.encode({"mac": server_challenge.server_mac(SECRET, nonce_r, nonce_s).hex()}))
            sock.sendall(ipc.encode({"ev": "ready", "name": "fake"}))
            sock.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return lsock, thread


@pytest.mark.parametrize("challenge,accepted", [(AGENT_CHALLENGE, False), (ROUTER_CHALLENGE, True)])
def test_a_router_refuses_a_worker_proof_made_for_the_agents(challenge, accepted):
    lsock, thread = _fake_worker(challenge)
    address = "127.0.0.1:%d" % lsock.getsockname()[1]

    async def main():
        channel, ready = await connect_worker(address, SECRET, timeout=10)
        channel.close()
        return ready

    try:
        if accepted:
            assert asyncio.run(main()) == {"ev": "ready", "name": "fake"}
        else:
            with pytest.raises(AuthenticationError):
                asyncio.run(main())
    finally:
        lsock.close()
        thread.join(10)


def test_the_router_channel_handshake_has_a_deadline(monkeypatch):
    """A router that drips its answer one byte at a time never lets a single read time
    out; the worker still closes it once the whole handshake is past its deadline and
    gives its pending slot back."""
    monkeypatch.setattr(netchannel, "HANDSHAKE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(netchannel, "_SWEEP_S", 0.1)
    chan = NetWorkerChannel("127.0.0.1:0", SECRET)
    try:
        with socket.create_connection(_address(chan), timeout=10) as sock:
            ipc.decode(*read_frame(sock, PREAUTH_MAX_FRAME))  # the worker's hello
            t0 = time.monotonic()
            sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, ipc.IPC_MSG, PREAUTH_MAX_FRAME))
            closed_after = None
            while time.monotonic() - t0 < 5.0:
                try:
                    sock.sendall(b" ")  # one byte of the payload every 0.2 s: each read waits < 1 s
                except OSError:
                    closed_after = time.monotonic() - t0
                    break
                readable, _, _ = select.select([sock], [], [], 0.2)
                if readable and sock.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
            assert closed_after is not None, "the worker kept a dripping handshake open past its deadline"
            assert closed_after < 3.0
        deadline = time.monotonic() + 5
        while chan._gate.total and time.monotonic() < deadline:
            time.sleep(0.05)
        assert chan._gate.total == 0
    finally:
        chan.close()


def test_a_silent_flood_does_not_lock_a_router_out_of_its_worker():
    """The worker channel admits through the same gate as the agents and store nodes: 80
    connections from the router's own address that never answer the worker's hello,
    reopened 4 times a second, leave >= 9 of 10 router handshakes succeeding."""
    chan = NetWorkerChannel("127.0.0.1:0", SECRET)
    chan.set_hello({"ev": "ready", "name": "w"})
    stop = threading.Event()
    host, port = _address(chan)

    async def attempt():
        channel, ready = await connect_worker(f"{host}:{port}", SECRET, timeout=10)
        channel.close()
        return ready

    thread, _ = silent_flood(f"{host}:{port}", stop)
    try:
        time.sleep(0.5)
        ok = 0
        for _ in range(10):
            try:
                ok += asyncio.run(attempt()) == {"ev": "ready", "name": "w"}
            except (kvxfer.KVXferError, ConnectionError, OSError, asyncio.TimeoutError):
                pass
        assert ok >= 9, f"{ok}/10 router handshakes got through"
    finally:
        stop.set()
        thread.join(10)
        chan.close()
