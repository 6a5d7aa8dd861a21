"""What the router does before and around a handler: bearer tokens, body size and
deadline, error bodies.

:class:`HTTPGuard` is a plain ASGI middleware (it never buffers a response, so
streaming is untouched):

- ``api_key`` set: every ``/v1/*`` and ``/metrics`` request needs
  ``Authorization: Bearer <key>`` (compared in constant time); otherwise 401.
  ``/health`` stays open (load balancers and orchestrators probe it).
- at most ``max_inflight`` requests run at once; beyond that a request gets 503,
  except ``/health`` and ``/metrics``, which are always answered (probes and
  monitoring must see a busy server; :mod:`kvxfer.serving.server.http_limits` keeps
  idle connections from taking their sockets).
- the request body is read before the handler runs: one larger than
  ``max_body_bytes`` gets 413 (at once when its ``Content-Length`` says so, or as
  soon as a chunked body passes the limit), one that has not fully arrived
  ``body_timeout_s`` after its headers gets 408; both close the connection.
  (Headers that never complete are the connection's business:
  :mod:`kvxfer.serving.server.http_limits`.)

:func:`install_error_handlers` turns every error the app can raise into an
OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}``:
validation errors are 400 ``invalid_request_error`` naming the parameter (the
offending input is never echoed: it may not even be serializable, e.g. ``NaN``
or a lone surrogate), HTTP errors keep their status, anything unexpected is a
logged 500 (never a reset connection).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math

from starlette.exceptions import HTTPException

from .api import error_body

log = logging.getLogger("kvxfer.serve")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
PROTECTED_PREFIXES = ("/v1/", "/metrics")
ALWAYS_ANSWERED = ("/health", "/metrics")  # never refused for load (the API key still guards /metrics)


def _json(status: int, message: str, kind: str, headers: tuple = ()) -> tuple[dict, dict]:
    body = json.dumps(error_body(message, kind, status)).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), *headers]}
    return start, {"type": "http.response.body", "body": body}


CLOSE = ((b"connection", b"close"),)  # the rest of the body is not read: end the connection


class HTTPGuard:
    """ASGI middleware: bearer-token check, body limit and body deadline (see the module doc)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_inflight: int | None = None):
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if max_inflight is not None and (type(max_inflight) is not int or max_inflight < 1):
            raise ValueError(f"max_inflight must be None or an int >= 1, got {max_inflight!r}")
        self.max_inflight = max_inflight
        self.inflight = 0
        if not body_timeout_s > 0 or math.isinf(body_timeout_s):
            raise ValueError(f"body_timeout_s must be finite and > 0, got {body_timeout_s!r}")
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = int(max_body_bytes)
        self.body_timeout_s = float(body_timeout_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in ALWAYS_ANSWERED or self.max_inflight is None:
            return await self._guarded(scope, receive, send)
        if self.inflight >= self.max_inflight:
            for msg in _json(503, f"{self.inflight} requests in flight; retry later", "server_error"):
                await send(msg)
            return
        self.inflight += 1
        try:
            return await self._guarded(scope, receive, send)
        finally:
            self.inflight -= 1

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or ())
        if self._key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            if not self._authorized(headers.get(b"authorization", b"")):
                for msg in _json(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                 "authentication_error", ((b"www-authenticate", b"Bearer"),)):
                    await send(msg)
                return
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            status, what = (413, f"request body exceeds {limit} bytes") if length.isdigit() \
                else (400, "malformed Content-Length")
            for msg in _json(status, what, "invalid_request_error", CLOSE):
                await send(msg)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: http.disconnect, for streaming responses

        await self.app(scope, replay, send)

    async def _read_body(self, receive, send) -> bytes | None:
        """The whole body, or None once a 408/413 went out (or the client left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                error = (408, f"request body not received within {self.body_timeout_s:g} s")
                break
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                error = (413, f"request body exceeds {self.max_body_bytes} bytes")
                break
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
        for msg in _json(*error, "invalid_request_error", CLOSE):
            await send(msg)
        return None

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


def _loc(err) -> str:
    return ".".join(str(x) for x in err.get("loc", ()) if x != "body")


def _describe(errors) -> str:
    parts = []
    for err in errors[:5]:
        loc = _loc(err)
        msg = "unknown parameter" if err.get("type") == "extra_forbidden" \
            else err.get("msg", "invalid")
        parts.append(f"{loc}: {msg}" if loc else str(msg))
    text = "; ".join(parts) or "invalid request"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(errors) -> str | None:
    """The first offending parameter's name (``messages.0.content``), as OpenAI's ``param``."""
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            # a union's branch names (``str``, ``list[int]``, ``TextPart``) are not parameters
            return ".".join(x for x in loc if x not in _TYPE_NAMES and "[" not in x
                            and not x[:1].isupper())
    return None


def install_error_handlers(app) -> None:
    """OpenAI-style error bodies for validation errors, HTTP errors and crashes."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        return JSONResponse(error_body(_describe(errors), "invalid_request_error", 400,
                                       _param(errors)), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.error("%s %s failed: %s: %s", request.method, request.url.path,
                  type(exc).__name__, exc, exc_info=exc)
        return JSONResponse(error_body("internal error", "server_error", 500), status_code=500)
