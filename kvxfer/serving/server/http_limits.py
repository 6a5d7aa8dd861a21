"""How long and how many: the HTTP connection limits ``kvxfer serve`` gives uvicorn.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not the
time a client may take to send its request headers, and its own concurrency limit
answers 503 to *every* request, ``/health`` included, once enough connections are
open, whatever they are doing: one client holding many connections that never
finish their headers would shut the server out. So the HTTP protocol kvxfer gives
uvicorn (:func:`protocol_class`) adds a header deadline and admits connections
through an :class:`Admission`:

- a source address holds at most ``max_connections_per_source`` connections;
- the server holds at most ``limit_concurrency`` (and never more than its open-file
  limit allows, :func:`kvxfer.net.raise_fd_limit`);
- when either bound is reached, the oldest connection that has not finished its
  request headers goes first (of that source, or of the source holding the most such
  connections); a new connection is refused (a 503 written at once, then closed) only
  when no connection waits for its headers.

In-flight requests are bounded by the ASGI middleware
(:class:`kvxfer.serving.server.guard.HTTPGuard`, 503 beyond ``limit_concurrency``), which
always answers ``/health`` and ``/metrics``; uvicorn's own limit is off. The body's
deadline is the middleware's too.

Together, with the defaults of :class:`~kvxfer.serving.server.serve_config.ServeConfig`:

=================================  ==============================================================
``header_timeout_s`` (10)          a request's headers must be complete this long after the
                                   connection opened or its previous response ended; else closed
``keep_alive_timeout_s`` 5         an idle connection (no byte since the last response) is closed
``body_timeout_s`` (30)            the body must be complete this long after the headers; else 408
``limit_concurrency`` 512          open connections (idle-header ones evicted first), and in-flight
                                   requests besides ``/health`` and ``/metrics`` (503 beyond)
``max_connections_per_source`` 64  open connections of one source address (idle-header ones evicted first)
=================================  ==============================================================
"""
from __future__ import annotations

import asyncio
import collections

FD_RESERVE = 64  # open files kept for everything but client connections (workers' channels, logs, discovery)
_REFUSED_BODY = (b'{"error":{"message":"too many connections; retry later","type":"server_error",'
                 b'"param":null,"code":503}}')
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"content-length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY)


class Admission:
    """Which connections the server keeps (one per server; event-loop thread only). See the
    module doc. ``evicted``/``refused`` count what it closed."""

    def __init__(self, max_connections: int, max_per_source: int) -> None:
        if type(max_connections) is not int or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        if type(max_per_source) is not int or max_per_source < 1:
            raise ValueError(f"max_per_source must be an int >= 1, got {max_per_source!r}")
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self._conns: dict = {}  # protocol -> source, oldest first
        self._per_source: collections.Counter = collections.Counter()
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._conns)

    def admit(self, proto, source: str) -> bool:
        """Take ``proto``'s new connection from ``source``, closing an idle-header one to make
        room; False (the caller refuses it) when every connection in its way is working."""
        if self._per_source[source] >= self.max_per_source and not self._evict(source):
            self.refused += 1
            return False
        if len(self._conns) >= self.max_connections and not self._evict(None):
            self.refused += 1
            return False
        self._conns[proto] = source
        self._per_source[source] += 1
        return True

    def forget(self, proto) -> None:
        source = self._conns.pop(proto, None)
        if source is not None:
            self._per_source[source] -= 1
            if not self._per_source[source]:
                del self._per_source[source]

    def _evict(self, source: str | None) -> bool:
        """Close the oldest connection waiting for its headers, of ``source`` or (None) of the
        source that holds the most of them; False if there is none."""
        waiting = [(p, s) for p, s in self._conns.items()
                   if (source is None or s == source) and p.waiting_for_headers()]
        if not waiting:
            return False
        if source is None:
            top = collections.Counter(s for _, s in waiting).most_common(1)[0][0]
            waiting = [(p, s) for p, s in waiting if s == top]
        victim = waiting[0][0]
        self.forget(victim)
        self.evicted += 1
        victim.transport.close()
        return True


def _base_protocol() -> type:
    """The protocol uvicorn's ``http="auto"`` picks: httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def protocol_class(header_timeout_s: float, base: type | None = None,
                   admission: Admission | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``base``; default: the one ``http="auto"`` picks) with a
    header deadline of ``header_timeout_s`` and, given one, ``admission`` of every new
    connection.

    The deadline is armed when the connection opens and again when a response
    ends (the next request's headers are due then); it is spent once the
    protocol has parsed a request's headers (a new request cycle exists). A
    connection still without headers at the deadline is closed.
    """
    if not header_timeout_s > 0 or header_timeout_s == float("inf"):
        raise ValueError(f"header_timeout_s must be finite and > 0, got {header_timeout_s!r}")
    base = base if base is not None else _base_protocol()

    class HeaderDeadlineProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport) -> None:
            if admission is not None:
                peer = transport.get_extra_info("peername")
                source = peer[0] if isinstance(peer, tuple) and peer else str(peer)
                if not admission.admit(self, source):
                    transport.write(REFUSED)
                    transport.close()
                    self.transport = transport
                    self._refused = True
                    return
            super().connection_made(transport)
            self._arm_header_deadline()

        def data_received(self, data) -> None:
            if not self._refused:
                super().data_received(data)

        def eof_received(self):
            if not self._refused:
                return super().eof_received()
            return None

        def waiting_for_headers(self) -> bool:
            """No request of this connection is in progress (its next headers are due)."""
            return not self._refused and self._waiting_for_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            if admission is not None:
                admission.forget(self)
            if self._refused:
                return
            self._cancel_header_deadline()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_deadline(self) -> None:
            self._cancel_header_deadline()
            if self.transport.is_closing() or not self._waiting_for_headers():
                return  # closed, or a pipelined request already began
            self._header_timer = self.loop.call_later(
                header_timeout_s, self._header_deadline_passed, self.cycle)

        def _cancel_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline_passed(self, armed_cycle) -> None:
            self._header_timer = None
            if self.cycle is armed_cycle and self._waiting_for_headers() \
                    and not self.transport.is_closing():
                self.transport.close()

    HeaderDeadlineProtocol.admission = admission  # what its connections are admitted by (None: everything)
    HeaderDeadlineProtocol.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadlineProtocol


def uvicorn_options(config, fd_limit: int | None = None) -> dict:
    """The keyword arguments ``uvicorn.run`` gets for ``config``
    (:class:`~kvxfer.serving.server.serve_config.ServeConfig`); ``fd_limit``: the process's
    open-file limit (:func:`kvxfer.net.raise_fd_limit`), which bounds the connections kept."""
    cap = config.limit_concurrency
    if fd_limit is not None:
        cap = max(1, min(cap, fd_limit - FD_RESERVE))
    admission = Admission(cap, min(config.max_connections_per_source, cap))
    return {"http": protocol_class(config.header_timeout_s, admission=admission),
            "timeout_keep_alive": config.keep_alive_timeout_s,
            "limit_concurrency": None,  # in-flight requests: HTTPGuard (it always answers /health, /metrics)
            "timeout_graceful_shutdown": int(config.drain_timeout_s)}
