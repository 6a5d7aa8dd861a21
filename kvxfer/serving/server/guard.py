"""What the router does before and around a handler: bearer tokens, body size, error bodies.

:class:`HTTPGuard` is a plain ASGI middleware (it never buffers a response, so
streaming is untouched):

- ``api_key`` set: every ``/v1/*`` and ``/metrics`` request needs
  ``Authorization: Bearer <key>`` (compared in constant time); otherwise 401.
  ``/health`` stays open (load balancers and orchestrators probe it).
- a request body larger than ``max_body_bytes`` gets 413: at once when its
  ``Content-Length`` says so, or as soon as a chunked body passes the limit.

:func:`install_error_handlers` turns every error the app can raise into an
OpenAI-style JSON body ``{"error": {"message", "type", "code"}}``: validation
errors are 400 ``invalid_request_error`` (the offending input is never echoed:
it may not even be serializable, e.g. ``NaN`` or a lone surrogate), HTTP errors
keep their status, anything unexpected is a logged 500 (never a reset connection).
"""
from __future__ import annotations

import hmac
import json
import logging

from starlette.exceptions import HTTPException

from .api import error_body

log = logging.getLogger("kvxfer.serve")

DEFAULT_MAX_BODY_BYTES = 1 << 20
PROTECTED_PREFIXES = ("/v1/", "/metrics")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds {limit} bytes")


def _json(status: int, message: str, kind: str, headers: tuple = ()) -> tuple[dict, dict]:
    body = json.dumps(error_body(message, kind, status)).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), *headers]}
    return start, {"type": "http.response.body", "body": body}


class HTTPGuard:
    """ASGI middleware: bearer-token check and request body limit (see the module doc)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = int(max_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
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
            for msg in _json(status, what, "invalid_request_error"):
                await send(msg)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


def _describe(errors) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
    text = "; ".join(parts) or "invalid request"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def install_error_handlers(app) -> None:
    """OpenAI-style error bodies for validation errors, HTTP errors and crashes."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return JSONResponse(error_body(_describe(exc.errors()), "invalid_request_error", 400),
                            status_code=400)

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
