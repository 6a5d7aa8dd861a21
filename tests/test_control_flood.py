"""Handshake floods and weak secrets.

The attacker connects from 127.0.0.2 (any 127/8 address reaches the loopback
listener) or from 127.0.0.1, the address it shares with every legitimate peer on
the host: a new connection is always admitted, evicting the oldest pending one of
its source (silent ones first), and failed handshakes lock no address out; the
legitimate peer must get through >= 90% of its attempts. How many get through a
reconnecting flood from its own address: ``benchmarks/handshake_flood.py``."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from kvxfer import Agent, AgentConfig
from kvxfer.config import MAX_PENDING_PER_SOURCE
from kvxfer import secrets as kvsecrets
from kvxfer import auth as gate
from kvxfer.framing import recv_frame
from kvxfer.auth import client_handshake
from kvxfer.agent.protocol import Msg, decode, encode
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


class _Pending:
    def __init__(self, source, said_hello=False):
        self.source, self.said_hello = source, said_hello


def test_gate_evicts_the_oldest_of_a_full_source_silent_ones_first():
    g = gate.HandshakeGate(max_pending=8, max_per_source=3)
    a = [_Pending("a", said_hello=True), _Pending("a"), _Pending("a")]
    for e in a:
        assert g.admit(e) == []
    new = _Pending("a")
    assert g.admit(new) == [a[1]]  # the oldest that said nothing; a[0] is further along
    assert g.pending("a") == [a[0], a[2], new]
    assert g.admit(_Pending("a", said_hello=True)) == [a[2]]
    new.said_hello = True
    assert g.admit(_Pending("a")) == [a[0]]  # all said HELLO: the oldest
    assert g.total == 3 and not g.release(a[0])  # an evicted entry holds no slot


def test_gate_full_table_evicts_from_the_source_holding_most():
    g = gate.HandshakeGate(max_pending=4, max_per_source=3)
    flood = [_Pending("x") for _ in range(3)]
    other = _Pending("y")
    for e in flood + [other]:
        assert g.admit(e) == []
    newcomer = _Pending("z")
    assert g.admit(newcomer) == [flood[0]]
    assert g.total == 4 and g.pending("y") == [other] and g.pending("z") == [newcomer]
    assert g.release(newcomer) and g.total == 3


def _said_hello(address, source):
    """A connection from ``source`` that sent its HELLO, got its CHALLENGE and stalls."""
    s = _dial(address, source)
    s.sendall(encode(Msg.HELLO, nonce=b"\1" * 32))
    kind, _ = decode(*recv_frame(s, T))
    assert kind == Msg.CHALLENGE
    return s


def test_new_connection_evicts_the_oldest_pending_of_its_full_source():
    srv = Agent("srv", secret=SECRET, backend="loopback", config=AgentConfig(handshake_timeout=120.0))
    srv.register_kv(make_pool("2 N B H D", None))
    host = srv.address.rsplit(":", 1)[0]
    c = Agent("cli", secret=SECRET, backend="loopback")
    stalled = []
    try:
        c.register_kv(make_pool("2 N B H D", 1))
        stalled = [_said_hello(srv.address, host) for _ in range(MAX_PENDING_PER_SOURCE)]
        peer = c.connect(srv.address, timeout=T)  # once refused (ConnectionRefused)
        assert peer.is_connected
        kind, fields = decode(*recv_frame(stalled[0], T))  # the oldest was told why, then closed
        assert kind == Msg.REJECT and fields["code"] == "busy"
        assert "pending handshakes" in fields["reason"]
        assert recv_frame_or_none(stalled[0]) is None
        assert srv.metrics.to_dict()["counters"]["evicted_handshakes"][0]["value"] == 1
    finally:
        for s in stalled:
            s.close()
        c.close()
        srv.close()


def recv_frame_or_none(s):
    s.settimeout(T)
    try:
        return recv_frame(s, T)
    except ConnectionError:
        return None


def _client_against(script: bytes):
    """Run the client handshake against a "server" that has already said ``script``."""
    a, b = socket.socketpair()
    try:
        b.sendall(script)
        b.shutdown(socket.SHUT_WR)
        client_handshake(a, SECRET, {}, lambda f: None, T)
    finally:
        a.close()
        b.close()


def test_a_refusal_is_connection_refused_and_says_only_that():
    busy = encode(Msg.REJECT, code="busy", reason="too many pending handshakes")
    with pytest.raises(ConnectionRefused) as before_hello:
        _client_against(busy)
    assert "closed" not in str(before_hello.value)  # was: "peer closed the connection ...: peer refused ..."
    assert str(before_hello.value) == "peer refused the connection: too many pending handshakes"
    with pytest.raises(ConnectionRefused):  # evicted while waiting for AUTH_OK (was AuthenticationError)
        _client_against(encode(Msg.CHALLENGE, nonce=b"\2" * 32) + busy)
    with pytest.raises(ConnectionRefused, match="before the handshake"):
        _client_against(b"")


def test_failed_handshakes_do_not_lock_out_their_address(server):
    """Wrong secrets and garbage from the legitimate peer's own address, then it connects."""
    host = server.address.rsplit(":", 1)[0]
    wrong = b"wrong-secret-0123456789"
    for _ in range(40):
        s = _dial(server.address, host)
        try:
            with pytest.raises(AuthenticationError):  # never ConnectionRefused: no lockout
                client_handshake(s, wrong, {}, lambda f: None, T)
        finally:
            s.close()
    for _ in range(40):
        s = _dial(server.address, host)
        try:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert recv_frame_or_none(s) is None  # closed at once
        finally:
            s.close()
    assert _legit_attempts(server, 3) == 3


def test_short_secrets_are_refused():
    for secret in (b"", b"x", "y" * 15, b"z" * 15):
        with pytest.raises(ValueError):
            Agent("x", secret=secret, backend="loopback")
    with pytest.raises(TypeError):
        Agent("x", secret=12345678901234567890, backend="loopback")
    assert len(kvsecrets.normalize_secret("s" * 16)) == 16
