"""Both halves of the connection handshake (see :mod:`kvxfer.control.auth`).

The connecting side runs :func:`client_handshake` to completion on a blocking
socket in the caller's thread. The accepting side is a :class:`ServerHandshake`
state machine driven by the I/O thread one frame at a time, so a slow or
hostile client never blocks other peers; the agent closes connections that do
not finish within :data:`HANDSHAKE_TIMEOUT_S`.
"""
from __future__ import annotations

import socket

from ..errors import AuthenticationError, ConnectionRefused, KVXferError, LayoutMismatch, ProtocolError
from . import auth
from .framing import recv_frame
from .messages import Msg, decode, encode

HANDSHAKE_TIMEOUT_S = 10.0


def _expect(sock, timeout: float, *kinds: Msg) -> tuple[Msg, dict]:
    """The next frame, one of ``kinds``; a REJECT raises its typed error. A closed or
    reset connection raises the builtin ConnectionError (never a KVXferError)."""
    kind, fields = decode(*recv_frame(sock, timeout))
    if kind == Msg.REJECT:
        if fields["code"] == "busy":
            raise ConnectionRefused(f"peer refused the connection: {fields['reason']}")
        if fields["code"] == "layout":
            raise LayoutMismatch(f"peer rejected our layout: {fields['reason']}")
        raise ProtocolError(f"peer rejected the connection: {fields['code']}: {fields['reason']}")
    if kind not in kinds:
        raise ProtocolError(f"expected {'/'.join(k.name for k in kinds)}, got {kind.name}")
    return kind, fields


def client_handshake(sock: socket.socket, secret: bytes, info: dict, check_info, timeout: float) -> dict:
    """Authenticate both ways, then swap INFO; return the peer's INFO fields.

    ``check_info(fields)`` validates the peer's INFO (raises LayoutMismatch /
    ProtocolError). Raises :class:`AuthenticationError` if either side's proof
    fails -- including the server closing on us, which is how a server that
    found our proof wrong may also answer.
    """
    nonce_c = auth.new_nonce()
    try:
        sock.sendall(encode(Msg.HELLO, nonce=nonce_c))
        _, fields = _expect(sock, timeout, Msg.CHALLENGE)
    except KVXferError:  # a REJECT: its own error (ConnectionRefused is a ConnectionError too)
        raise
    except ConnectionError as exc:  # closed before it said anything: it took no handshake
        raise ConnectionRefused(f"peer closed the connection before the handshake: {exc}") from None
    nonce_s = fields["nonce"]
    try:
        sock.sendall(encode(Msg.AUTH, mac=auth.client_mac(secret, nonce_s, nonce_c)))
        kind, fields = _expect(sock, timeout, Msg.AUTH_OK, Msg.AUTH_FAIL)
    except KVXferError:  # e.g. REJECT busy: evicted while it waited for our proof
        raise
    except ConnectionError:
        raise AuthenticationError("peer closed the connection during authentication") from None
    if kind == Msg.AUTH_FAIL:
        raise AuthenticationError("peer refused our proof of the shared secret")
    if not auth.verify(auth.server_mac(secret, nonce_c, nonce_s), fields["mac"]):
        raise AuthenticationError("peer failed to prove the shared secret")
    sock.sendall(encode(Msg.INFO, **info))
    _, fields = _expect(sock, timeout, Msg.INFO)
    try:
        check_info(fields)
    except LayoutMismatch as exc:
        sock.sendall(encode(Msg.REJECT, code="layout", reason=str(exc)[:200]))
        raise
    return fields


class ServerHandshake:
    """Accepting side: HELLO -> CHALLENGE, AUTH -> AUTH_OK, INFO -> INFO, ready.

    :meth:`on_frame` returns the frames to send and whether the peer is ready.
    Failures raise; the agent then sends :attr:`reply_on_error` (if any) and closes.
    """

    def __init__(self, secret: bytes, make_info, check_info) -> None:
        self._secret = secret
        self._make_info = make_info
        self._check_info = check_info
        self._state = Msg.HELLO
        self._nonce_c = self._nonce_s = b""
        self.peer_info: dict | None = None
        self.reply_on_error: bytes | None = None

    @property
    def state(self) -> Msg:
        """The message expected next (HELLO, AUTH, INFO; REJECT once done)."""
        return self._state

    def on_frame(self, kind: Msg, fields: dict) -> tuple[list, bool]:
        if kind != self._state:
            raise ProtocolError(f"handshake expected {self._state.name}, got {kind.name}")
        if kind == Msg.HELLO:
            self._nonce_c, self._nonce_s = fields["nonce"], auth.new_nonce()
            self._state = Msg.AUTH
            return [encode(Msg.CHALLENGE, nonce=self._nonce_s)], False
        if kind == Msg.AUTH:
            expected = auth.client_mac(self._secret, self._nonce_s, self._nonce_c)
            if not auth.verify(expected, fields["mac"]):
                self.reply_on_error = encode(Msg.AUTH_FAIL)
                raise AuthenticationError("client failed the challenge")
            self._state = Msg.INFO
            return [encode(Msg.AUTH_OK, mac=auth.server_mac(self._secret, self._nonce_c, self._nonce_s))], False
        # INFO: the client is authenticated; only now do keys and layouts flow
        try:
            self._check_info(fields)
        except LayoutMismatch as exc:
            self.reply_on_error = encode(Msg.REJECT, code="layout", reason=str(exc)[:200])
            raise
        self.peer_info = fields
        self._state = Msg.REJECT  # nothing more is expected from the handshake
        return [encode(Msg.INFO, **self._make_info())], True
