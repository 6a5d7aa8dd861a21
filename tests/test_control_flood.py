"""Handshake floods (issue 9, item 3) and weak secrets (item 15, agent part).

The attacker connects from 127.0.0.2 (any 127/8 address reaches the loopback
listener), the legitimate agent from 127.0.0.1: per-source limits keep the
attacker's half-open or reconnecting connections from taking the slots the
legitimate peer needs; it must get through >= 90% of its attempts."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from kvxfer import Agent
from kvxfer.control import auth, gate
from kvxfer.control.handshake import client_handshake
from kvxfer.control.messages import Msg, encode
from kvxfer.errors import AuthenticationError, ConnectionRefused, PeerDisconnected

from agent_procs import SECRET, make_pool

T = 20.0
ATTACKER = "127.0.0.2"


@pytest.fixture
def server():
    a = Agent("srv", secret=SECRET, backend="loopback")
    a.register_kv(make_pool("2 N B H D", None))
    yield a
    a.close()


def _dial(address, source=ATTACKER):
    host, port = address.rsplit(":", 1)
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(T)
    s.connect((host, int(port)))
    return s


def _legit_attempts(server, n=10) -> int:
    ok = 0
    for _ in range(n):
        c = Agent("cli", secret=SECRET, backend="loopback")
        try:
            c.register_kv(make_pool("2 N B H D", 1))
            c.connect(server.address, timeout=T)
            ok += 1
        except (ConnectionRefused, PeerDisconnected, AuthenticationError):
            pass
        finally:
            c.close()
    return ok


def test_200_half_open_connections_do_not_shut_out_a_peer(server):
    idle = []
    try:
        for _ in range(200):
            try:
                idle.append(_dial(server.address))
            except OSError:
                break
        ok = _legit_attempts(server)
        assert ok >= 9, f"{ok}/10 legitimate connects got through"
    finally:
        for s in idle:
            s.close()


def test_reconnecting_attacker_does_not_shut_out_a_peer(server):
    stop = threading.Event()
    made = [0]

    def attack():
        socks = []
        while not stop.is_set():
            try:
                s = _dial(server.address)
                s.sendall(encode(Msg.HELLO, nonce=b"\1" * 32)[:5])  # a partial HELLO, then nothing
                socks.append(s)
                made[0] += 1
            except OSError:
                pass
            if len(socks) >= 48:  # drop the oldest, reconnect
                socks.pop(0).close()
        for s in socks:
            s.close()

    threads = [threading.Thread(target=attack, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        ok = _legit_attempts(server)
    finally:
        stop.set()
        for t in threads:
            t.join(T)
    assert made[0] > 100
    assert ok >= 9, f"{ok}/10 legitimate connects got through"


def test_refused_connection_is_a_typed_error(server):
    host = server.address.rsplit(":", 1)[0]
    idle = [_dial(server.address, host) for _ in range(gate.MAX_PENDING_PER_SOURCE)]
    try:
        c = Agent("cli", secret=SECRET, backend="loopback")
        try:
            c.register_kv(make_pool("2 N B H D", 1))
            with pytest.raises(ConnectionRefused):
                c.connect(server.address, timeout=T)
        finally:
            c.close()
    finally:
        for s in idle:
            s.close()


def test_failed_handshakes_are_rate_limited_per_source(server):
    wrong = b"wrong-secret-0123456789"
    errors = []
    for _ in range(gate.MAX_FAILURES_PER_SOURCE + 4):
        s = _dial(server.address)
        try:
            client_handshake(s, wrong, {}, lambda f: None, T)
        except (AuthenticationError, ConnectionRefused) as exc:
            errors.append(type(exc))
        finally:
            s.close()
    assert errors[0] is AuthenticationError and errors[-1] is ConnectionRefused
    assert _legit_attempts(server, 3) == 3  # other sources are not affected


def test_short_secrets_are_refused():
    for secret in (b"", b"x", "y" * 15, b"z" * 15):
        with pytest.raises(ValueError):
            Agent("x", secret=secret, backend="loopback")
    with pytest.raises(TypeError):
        Agent("x", secret=12345678901234567890, backend="loopback")
    assert len(auth.normalize_secret("s" * 16)) == 16
