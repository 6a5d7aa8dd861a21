"""The header deadline kvxfer serve adds to uvicorn (``http_limits.protocol_class``), on
both of uvicorn's HTTP protocols, over a real uvicorn server with a trivial app.

Only "closed before a generous deadline" is asserted, never how fast.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from kvxfer.serving.server.http_limits import protocol_class  # noqa: E402
from waiting import until_closed  # noqa: E402

HEADER_TIMEOUT_S = 0.5
CLOSED_WITHIN_S = 30.0


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _bases():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    bases = [pytest.param(H11Protocol, id="h11")]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        pass
    else:
        bases.append(pytest.param(HttpToolsProtocol, id="httptools"))
    return bases


@pytest.fixture(params=_bases())
def server(request):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, http=protocol_class(HEADER_TIMEOUT_S, request.param),
                            log_level="warning", lifespan="off", timeout_keep_alive=60)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield sock.getsockname()[1]
    srv.should_exit = True
    thread.join(timeout=30)
    sock.close()


def _closed(s: socket.socket) -> bytes:
    """What arrived before the server closed ``s`` (AssertionError if it stays open)."""
    return until_closed(s, time.monotonic() + CLOSED_WITHIN_S)


def test_silent_and_half_sent_headers_are_closed(server):
    silent = socket.create_connection(("127.0.0.1", server))
    half = socket.create_connection(("127.0.0.1", server))
    half.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert _closed(silent) == b"" and _closed(half) == b""


def test_the_next_requests_headers_are_due_after_a_response(server):
    """Keep-alive is 60 s here: the header deadline, re-armed after the response,
    closes a connection that starts its next request and stalls."""
    s = socket.create_connection(("127.0.0.1", server))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(CLOSED_WITHIN_S)
    first = b""
    while not first.endswith(b"ok"):
        first += s.recv(4096)
    assert first.startswith(b"HTTP/1.1 200")
    s.sendall(b"GET / HT")
    assert _closed(s) == b""


def test_a_request_in_progress_is_not_cut(server):
    """A slow body is the body deadline's business (HTTPGuard), not the header deadline's."""
    s = socket.create_connection(("127.0.0.1", server))
    s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
    time.sleep(4 * HEADER_TIMEOUT_S)  # well past the header deadline
    s.sendall(b"cd")
    s.settimeout(CLOSED_WITHIN_S)
    reply = b""
    while not reply.endswith(b"ok"):
        chunk = s.recv(4096)
        assert chunk, f"closed mid-request: {reply!r}"
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")
    s.close()


def test_bad_deadlines_are_refused():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            protocol_class(bad)
