"""The control port under attack or misuse: wrong secrets, layout mismatches,
raw garbage. The agent keeps serving its good peers throughout."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from kvxfer import Agent
from kvxfer.framing import HEADER
from kvxfer.agent.protocol import Msg, encode
from kvxfer.errors import AuthenticationError, LayoutMismatch, ProtocolError

from agent_procs import SECRET, make_pool

T = 20.0


@pytest.fixture
def server():
    a = Agent("srv", secret=SECRET, backend="loopback")
    a.register_kv(make_pool("2 N B H D", None))
    yield a
    a.close()


def _client(secret=SECRET, **shape):
    c = Agent("cli", secret=secret, backend="loopback")
    c.register_kv(make_pool("2 N B H D", 1, shape=shape or None))
    return c


def roundtrip_works(server) -> bool:
    c = _client()
    try:
        peer = c.connect(server.address)
        h = server.recv(f"probe-{time.monotonic_ns()}", [0], timeout=T)
        c.send(peer, h.request_id, [1]).wait(T)
        h.wait(T)
        return True
    finally:
        c.close()


def test_wrong_secret_gets_authentication_error_and_no_keys(server):
    c = _client(secret=b"not-the-secret-0123456789")
    try:
        with pytest.raises(AuthenticationError):
            c.connect(server.address)
        assert server.peers() == [] and c.peers() == []
    finally:
        c.close()
    assert roundtrip_works(server)


def test_server_with_other_secret_is_refused(server):
    other = Agent("imposter", secret=b"other-secret-0123456789", backend="loopback")
    c = _client()
    try:
        with pytest.raises(AuthenticationError):
            c.connect(other.address)
    finally:
        c.close()
        other.close()


def test_layout_mismatch(server):
    c = _client(B=8)  # a different block size cannot be converted
    try:
        with pytest.raises(LayoutMismatch):
            c.connect(server.address)
    finally:
        c.close()
    assert roundtrip_works(server)


def _raw(address):
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=T)
    s.settimeout(T)
    return s


def _closed_by_server(sock) -> bool:
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    finally:
        sock.close()


@pytest.mark.parametrize("blob", [
    os.urandom(64),
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    HEADER.pack(b"KX", 1, int(Msg.HELLO), 1 << 30),  # huge length
    HEADER.pack(b"KX", 7, int(Msg.HELLO), 2) + b"{}",  # other protocol version
    encode(Msg.HELLO, nonce=b"\0" * 32)[:-3],  # truncated, then hang up
    encode(Msg.INFO, name="x", agent_id="y", layout={}, backend=b"", staging=1),  # skips auth
    encode(Msg.RECV_POST, req="r", xid=1, blocks=[0], layers=[0], heads=(0, 1), skip=0),
])
def test_garbage_on_control_port(server, blob):
    s = _raw(server.address)
    s.sendall(blob)
    s.shutdown(socket.SHUT_WR)  # a truncated frame must not hold the connection open
    assert _closed_by_server(s)
    assert roundtrip_works(server)


def test_garbage_after_a_valid_hello_and_many_idle_connections(server):
    idle = [_raw(server.address) for _ in range(8)]  # never say anything
    s = _raw(server.address)
    s.sendall(encode(Msg.HELLO, nonce=b"\1" * 32))
    hdr = s.recv(HEADER.size)
    assert hdr[:2] == b"KX"
    s.sendall(b"\x00" * 40)
    assert _closed_by_server(s)
    assert roundtrip_works(server)
    for sock in idle:
        sock.close()


def test_missing_secret_is_an_argument_error():
    with pytest.raises(TypeError):
        Agent("x", backend="loopback")  # secret is keyword-only and required
    with pytest.raises(ValueError):
        Agent("x", secret=b"", backend="loopback")


def test_client_rejects_server_speaking_another_version():
    import threading

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)

    def fake_server():
        conn, _ = lsock.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(HEADER.pack(b"KX", 9, int(Msg.CHALLENGE), 2) + b"{}")
            try:
                conn.recv(4096)  # until the client hangs up
            except OSError:
                pass

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    c = _client()
    try:
        with pytest.raises(ProtocolError, match="version"):
            c.connect(f"127.0.0.1:{lsock.getsockname()[1]}", timeout=T)
    finally:
        c.close()
        lsock.close()
        t.join(T)


def test_slow_reader_never_blocks_the_sender(server):
    """Flood a peer that does not read: send() returns at once, order is kept,
    and everything arrives once the reader drains."""
    from kvxfer.framing import FrameReader
    from kvxfer.agent.protocol import decode

    a, b = socket.socketpair()
    closed = []
    handler = type("H", (), {"on_frame": lambda *x: None, "on_close": lambda s, c, e: closed.append(e)})()
    conn = server._state.loop.add_conn(a, handler)
    frames = [encode(Msg.ACK, tag=i) for i in range(20000)]  # ~0.5 MB, more than a socket buffer
    for f in frames:
        assert conn.send(f)
    reader, got = FrameReader(), []
    b.settimeout(T)
    while len(got) < len(frames):
        got += reader.feed(b.recv(1 << 16))
    assert [decode(*f)[1]["tag"] for f in got] == list(range(len(frames)))
    assert closed == []
    b.close()


def test_handler_errors_are_logged_and_the_loop_goes_on(server, caplog):
    """A frame handler that raises a non-kvxfer error, then a close handler that raises:
    both are logged with their traceback, the connection is dropped, the loop still serves."""
    a, b = socket.socketpair()
    closed = threading.Event()

    def on_frame(self, conn, kind, fields):
        raise RuntimeError("handler bug")

    def on_close(self, conn, exc):
        closed.set()
        raise RuntimeError("close handler bug")

    handler = type("H", (), {"on_frame": on_frame, "on_close": on_close})()
    with caplog.at_level(logging.ERROR, logger="kvxfer"):
        server._state.loop.add_conn(a, handler)
        b.sendall(encode(Msg.ACK, tag=1))
        assert closed.wait(T)
        deadline = time.monotonic() + T
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    messages = [r.getMessage() for r in caplog.records]
    assert any("frame handler raised" in m for m in messages), messages
    assert any("close handler" in m for m in messages), messages
    assert all(r.exc_info for r in caplog.records if "handler" in r.getMessage())
    b.close()
    assert server._state.loop.thread.is_alive()
