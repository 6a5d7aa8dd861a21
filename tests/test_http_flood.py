"""The HTTP front door under a slow-header flood, with real sockets: a separate process
holds 1,000 connections from 127.0.0.2 that never finish their headers and reopens each
one the server closes; legitimate requests from 127.0.0.1 must keep succeeding (>= 90%),
and ``/health`` and ``/metrics`` must always be answered. Also: the admission's rules one
by one, and in-flight requests beyond the limit get 503 while the probes do not."""
from __future__ import annotations

import asyncio
import http.client
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from kvxfer.serving.server.guard import HTTPGuard  # noqa: E402
from kvxfer.net import raise_fd_limit  # noqa: E402
from kvxfer.serving.server.http_limits import Admission, protocol_class  # noqa: E402

T = 30.0


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _serve(admission: Admission, max_inflight: int | None = None, header_timeout_s: float = 10.0):
    """A real uvicorn server on 127.0.0.1 (all loopback addresses) with kvxfer's admission and guard."""
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    app = HTTPGuard(_app, api_key=None, max_inflight=max_inflight)
    config = uvicorn.Config(app, http=protocol_class(header_timeout_s, admission=admission), log_level="error",
                            lifespan="off", limit_concurrency=None, backlog=2048)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + T
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return srv, thread, sock


def _stop(srv, thread, sock) -> None:
    srv.should_exit = True
    thread.join(timeout=T)
    sock.close()


def _get(port: int, path: str, source: str = "127.0.0.1") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


FLOOD = textwrap.dedent("""
    import selectors, socket, sys, time
    port, n, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    sel = selectors.DefaultSelector()
    def opened():
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, [False])
    for _ in range(n):
        opened()
    print("flooding", flush=True)
    reopened, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for key, mask in sel.select(0.05):
            s, sent = key.fileobj, key.data
            if mask & selectors.EVENT_WRITE and not sent[0]:
                try:
                    s.send(b"GET /v1/x HTTP/1.1\\r\\nHost: x\\r\\nX-Slow: ")  # and never the rest
                except OSError:
                    pass
                sent[0] = True
                sel.modify(s, selectors.EVENT_READ, sent)
            elif mask & selectors.EVENT_READ:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:  # closed by the server: open another one
                    sel.unregister(s)
                    s.close()
                    opened()
                    reopened += 1
    print("reopened", reopened, flush=True)
""")


def test_legitimate_requests_succeed_under_a_slow_header_flood():
    """The defaults of ``kvxfer serve`` (512 connections, 64 a source)."""
    limits = (512, 64)
    raise_fd_limit()
    admission = Admission(*limits)
    server = _serve(admission, max_inflight=limits[0])
    port = server[2].getsockname()[1]
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), "1000", "60"], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert flood.stdout.readline().strip() == "flooding"
        deadline = time.monotonic() + T
        while admission.evicted < limits[0] and time.monotonic() < deadline:  # the flood fills every slot
            time.sleep(0.05)
        assert admission.evicted >= limits[0] and flood.poll() is None
        ok = sum(_get(port, f"/v1/{i}") == 200 for i in range(40))
        probes = [_get(port, path) for path in ("/health", "/metrics") * 5]
        assert ok >= 36, f"{ok}/40 legitimate requests succeeded"  # none before the admission
        assert probes.count(200) >= 9, probes
        assert len(admission) <= limits[0]
    finally:
        flood.kill()
        flood.wait(T)
        _stop(*server)


def test_admission_evicts_idle_headers_first_and_refuses_only_when_all_work():
    admission = Admission(max_connections=4, max_per_source=3)
    server = _serve(admission)
    port = server[2].getsockname()[1]
    socks = []
    try:
        for _ in range(3):  # three idle-header connections from .2: its cap
            s = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        _until(lambda: len(admission) == 3)
        fourth = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
        _until(lambda: admission.evicted == 1)  # its own oldest idle one went
        assert _closed(socks[0]) == b""
        assert _get(port, "/ok") == 200  # from .1: a slot is found
        busy = [threading.Thread(target=_get, args=(port, "/slow", f"127.0.0.{3 + i}")) for i in range(4)]
        fourth.close()
        for s in socks[1:]:
            s.close()
        _until(lambda: len(admission) == 0)
        for t in busy:
            t.start()
        _until(lambda: len(admission) == 4)  # four requests in progress: nothing to evict
        late = socket.create_connection(("127.0.0.1", port))
        late.settimeout(T)
        assert _closed(late).startswith(b"HTTP/1.1 503")
        assert admission.refused == 1
        for t in busy:
            t.join(T)
    finally:
        for s in socks:
            s.close()
        _stop(*server)


def test_inflight_limit_spares_health_and_metrics():
    server = _serve(Admission(64, 64), max_inflight=2)
    port = server[2].getsockname()[1]
    try:
        busy = [threading.Thread(target=_get, args=(port, "/slow")) for _ in range(2)]
        for t in busy:
            t.start()
        time.sleep(0.3)  # both in flight (each takes 1 s)
        assert _get(port, "/v1/x") == 503
        assert _get(port, "/health") == 200 and _get(port, "/metrics") == 200
        for t in busy:
            t.join(T)
        assert _get(port, "/v1/x") == 200
    finally:
        _stop(*server)


def test_bad_limits_are_refused():
    for bad in ((0, 1), (1, 0), (1.5, 1)):
        with pytest.raises(ValueError):
            Admission(*bad)
    with pytest.raises(ValueError):
        HTTPGuard(_app, api_key=None, max_inflight=0)


def _until(cond, timeout=T):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _closed(s: socket.socket) -> bytes:
    s.settimeout(T)
    out = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            return out
        out += chunk
