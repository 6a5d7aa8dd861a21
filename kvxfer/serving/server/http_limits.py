"""How long and how many: the HTTP connection limits ``kvxfer serve`` gives uvicorn.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) and the
number of open connections and in-flight requests (``limit_concurrency``:
beyond it, a request gets 503 and its connection is closed), but not the time a
client may take to send its request headers: a connection that opens and then
sends half a request line, or one byte a minute, would hold its socket forever.
:func:`protocol_class` adds that deadline to uvicorn's HTTP protocol; the body's
deadline is the ASGI middleware's (:class:`kvxfer.serving.server.guard.HTTPGuard`).

Together, with the defaults of :class:`~kvxfer.serving.server.serve_config.ServeConfig`:

==========================  ==============================================================
``header_timeout_s`` (10)   a request's headers must be complete this long after the
                            connection opened or its previous response ended; else closed
``keep_alive_timeout_s`` 5  an idle connection (no byte since the last response) is closed
``body_timeout_s`` (30)     the body must be complete this long after the headers; else 408
``limit_concurrency`` 512   open connections or in-flight requests beyond this: 503
==========================  ==============================================================
"""
from __future__ import annotations

import asyncio


def _base_protocol() -> type:
    """The protocol uvicorn's ``http="auto"`` picks: httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def protocol_class(header_timeout_s: float, base: type | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``base``; default: the one ``http="auto"`` picks) with a
    header deadline of ``header_timeout_s``.

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

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
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

    HeaderDeadlineProtocol.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadlineProtocol


def uvicorn_options(config) -> dict:
    """The keyword arguments ``uvicorn.run`` gets for ``config``
    (:class:`~kvxfer.serving.server.serve_config.ServeConfig`)."""
    return {"http": protocol_class(config.header_timeout_s),
            "timeout_keep_alive": config.keep_alive_timeout_s,
            "limit_concurrency": config.limit_concurrency,
            "timeout_graceful_shutdown": int(config.drain_timeout_s)}
