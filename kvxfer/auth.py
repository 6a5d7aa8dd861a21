"""Authentication and admission of every kvxfer listener: HMAC proofs, the handshake's
messages, both halves of the handshake, and the pre-auth gate.

The agents and the store nodes speak this handshake on their control connections; the
serving workers' router channel uses the same proof (:class:`HmacChallenge`, under a
domain of its own) and the same gate.

Mutual challenge-response over a shared secret (HMAC-SHA256). Sequence (C connects, S accepts)::

    C -> S  HELLO     nonce_c                     (fresh 32 random bytes)
    S -> C  CHALLENGE nonce_s
    C -> S  AUTH      HMAC(secret, "kvxfer-C" | nonce_s | nonce_c)   (AGENT_CHALLENGE.client_mac)
    S -> C  AUTH_OK   HMAC(secret, "kvxfer-S" | nonce_c | nonce_s)   or AUTH_FAIL, close
    C <-> S INFO      name, layout geometry, backend metadata (keys)

The secret never crosses the wire; both MACs bind both nonces, so neither can be
replayed into another session. S proves itself only after C did, so a client
without the secret gets nothing but a random nonce: no MAC to attack offline,
no layout, no keys. C checks S's proof before it sends its own INFO.

The connecting side runs :func:`client_handshake` to completion on a blocking
socket in the caller's thread. The accepting side is a :class:`ServerHandshake`
state machine driven by the I/O thread one frame at a time, so a slow or
hostile client never blocks other peers; the listener closes connections that do
not finish within the handshake timeout.

Admission of unauthenticated connections (:class:`HandshakeGate`): cheap, bounded,
and never a lockout. Before a connection has proved the shared secret it may cost
this agent little: it holds one of ``MAX_PENDING_HANDSHAKES`` slots, at most
``MAX_PENDING_PER_SOURCE`` of them per source address, must send its HELLO
within ``HELLO_DEADLINE_S`` and authenticate within the handshake timeout,
and may buffer at most ``PREAUTH_MAX_FRAME`` bytes (these bounds live in
:mod:`kvxfer.config`, shared by every listener: agents, store nodes, the router
channel). A connection frees its slot the moment it authenticates.

A new connection is always admitted. When its source holds all its slots, the
source's oldest pending connection is evicted to make room; when all slots are
taken, the oldest of the source holding the most. Connections that have not sent
their HELLO yet go first, so an honest client -- whose HELLO follows its connect
at once and whose handshake takes milliseconds -- outlives any number of half-open
or reconnecting ones, also from its own address. An evicted connection gets a
REJECT (``code="busy"``) and is closed; its client raises
:class:`~kvxfer.errors.ConnectionRefused`. A failed handshake costs the one
connection that failed (it is closed at once) and nothing else: failures are not
counted per address, so nobody can lock an address out. The gate runs on the I/O
thread only (each listener's one I/O thread).

The handshake's messages (:class:`Hs`, :data:`SCHEMAS`) are JSON payloads in the
field kinds of :mod:`kvxfer.fields`, framed by :mod:`kvxfer.framing`; their type
numbers (1-7) come first in every control protocol that starts with this handshake.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import os
import socket

import enum

from .config import MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_SOURCE
from .errors import AuthenticationError, ConnectionRefused, KVXferError, LayoutMismatch, ProtocolError
from .fields import decode_json, encode_json
from .framing import encode_frame, recv_frame

__all__ = ["Hs", "SCHEMAS", "encode", "decode", "NONCE_BYTES", "HmacChallenge", "AGENT_CHALLENGE",
           "client_handshake", "ServerHandshake", "HandshakeGate"]


# ---- the handshake's messages -------------------------------------------------------
class Hs(enum.IntEnum):
    """The handshake's message types (connecting side C, accepting side S), in order."""
    HELLO = 1        # C->S: nonce_c
    CHALLENGE = 2    # S->C: nonce_s
    AUTH = 3         # C->S: HMAC(secret, "C" | nonce_s | nonce_c)
    AUTH_OK = 4      # S->C: HMAC(secret, "S" | nonce_c | nonce_s)
    AUTH_FAIL = 5    # S->C, then close
    INFO = 6         # both ways, only after AUTH_OK: name, layout, backend metadata
    REJECT = 7       # either way, then close: layout mismatch, busy, etc.


SCHEMAS: dict[Hs, dict[str, str]] = {
    Hs.HELLO: {"nonce": "hex32"},
    Hs.CHALLENGE: {"nonce": "hex32"},
    Hs.AUTH: {"mac": "hex32"},
    Hs.AUTH_OK: {"mac": "hex32"},
    Hs.AUTH_FAIL: {},
    Hs.INFO: {"name": "str", "agent_id": "str", "layout": "obj", "backend": "b64", "staging": "int"},
    Hs.REJECT: {"code": "str", "reason": "str"},
}
_KINDS = {int(k): k for k in Hs}


def encode(kind: Hs, **fields) -> bytes:
    """One framed handshake message; ``fields`` must match its schema exactly (else ValueError)."""
    return encode_frame(int(kind), encode_json(kind.name, SCHEMAS[kind], fields))


def decode(msg_type: int, payload: bytes) -> tuple[Hs, dict]:
    """Validate one received handshake frame; ``(type, fields)``, or ProtocolError (any
    other type included)."""
    kind = _KINDS.get(msg_type)
    if kind is None:
        raise ProtocolError(f"message type {msg_type} is not part of the handshake")
    return kind, decode_json(kind.name, SCHEMAS[kind], payload)


# ---- proofs of the shared secret -------------------------------------------------
NONCE_BYTES = 32


class HmacChallenge:
    """The mutual HMAC-SHA256 challenge of one protocol over a deployment's shared secret.

    C (the side that proves first) answers S's nonce; S then proves itself::

        client_mac = HMAC(secret, domain | "-C" | nonce_s | nonce_c)
        server_mac = HMAC(secret, domain | "-S" | nonce_c | nonce_s)

    ``domain`` (bytes) names the protocol. Every protocol that shares the secret has its
    own -- :data:`AGENT_CHALLENGE` for the agents' and store nodes' control connections,
    the serving workers' router channel another -- and since both nonces are exactly
    :data:`NONCE_BYTES` long, the label is fixed by the message's length: a proof made
    for one protocol (or one direction) is never valid in another. A nonce of another
    length raises ValueError. The one implementation of the challenge; its pre-auth
    bounds are in :mod:`kvxfer.config` (``PREAUTH_MAX_FRAME``, ``HANDSHAKE_TIMEOUT_S``).
    """

    __slots__ = ("domain",)

    def __init__(self, domain: bytes) -> None:
        if not isinstance(domain, bytes) or not domain:
            raise TypeError(f"a challenge's domain must be non-empty bytes, got {domain!r}")
        self.domain = domain

    @staticmethod
    def new_nonce() -> bytes:
        """A fresh nonce: :data:`NONCE_BYTES` random bytes."""
        return os.urandom(NONCE_BYTES)

    def client_mac(self, secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
        """C's proof: it answers ``nonce_s`` (S's challenge) in the session C opened with ``nonce_c``."""
        return self._mac(secret, b"-C", nonce_s, nonce_c)

    def server_mac(self, secret: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
        """S's proof, given only after C's checked out."""
        return self._mac(secret, b"-S", nonce_c, nonce_s)

    @staticmethod
    def verify(expected: bytes, got: bytes) -> bool:
        """Whether ``got`` is the proof ``expected`` (constant time)."""
        return hmac.compare_digest(expected, got)

    def _mac(self, secret: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
        if len(first) != NONCE_BYTES or len(second) != NONCE_BYTES:
            raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(first)} and {len(second)}")
        return hmac.new(secret, self.domain + side + first + second, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"HmacChallenge({self.domain!r})"


AGENT_CHALLENGE = HmacChallenge(b"kvxfer")  # the agents' and store nodes' handshake (below)


# ---- the two halves -------------------------------------------------------------
def _expect(sock, timeout: float, *kinds: Hs) -> tuple[Hs, dict]:
    """The next frame, one of ``kinds``; a REJECT raises its typed error. A closed or
    reset connection raises the builtin ConnectionError (never a KVXferError)."""
    kind, fields = decode(*recv_frame(sock, timeout))
    if kind == Hs.REJECT:
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
    nonce_c = AGENT_CHALLENGE.new_nonce()
    try:
        sock.sendall(encode(Hs.HELLO, nonce=nonce_c))
        _, fields = _expect(sock, timeout, Hs.CHALLENGE)
    except KVXferError:  # a REJECT: its own error (ConnectionRefused is a ConnectionError too)
        raise
    except ConnectionError as exc:  # closed before it said anything: it took no handshake
        raise ConnectionRefused(f"peer closed the connection before the handshake: {exc}") from None
    nonce_s = fields["nonce"]
    try:
        sock.sendall(encode(Hs.AUTH, mac=AGENT_CHALLENGE.client_mac(secret, nonce_s, nonce_c)))
        kind, fields = _expect(sock, timeout, Hs.AUTH_OK, Hs.AUTH_FAIL)
    except KVXferError:  # e.g. REJECT busy: evicted while it waited for our proof
        raise
    except ConnectionError:
        raise AuthenticationError("peer closed the connection during authentication") from None
    if kind == Hs.AUTH_FAIL:
        raise AuthenticationError("peer refused our proof of the shared secret")
    if not AGENT_CHALLENGE.verify(AGENT_CHALLENGE.server_mac(secret, nonce_c, nonce_s), fields["mac"]):
        raise AuthenticationError("peer failed to prove the shared secret")
    sock.sendall(encode(Hs.INFO, **info))
    _, fields = _expect(sock, timeout, Hs.INFO)
    try:
        check_info(fields)
    except LayoutMismatch as exc:
        sock.sendall(encode(Hs.REJECT, code="layout", reason=str(exc)[:200]))
        raise
    return fields


class ServerHandshake:
    """Accepting side: HELLO -> CHALLENGE, AUTH -> AUTH_OK, INFO -> INFO, ready.

    :meth:`on_frame` returns the frames to send and whether the peer is ready.
    Failures raise; the listener then sends :attr:`reply_on_error` (if any) and closes.
    """

    def __init__(self, secret: bytes, make_info, check_info) -> None:
        self._secret = secret
        self._make_info = make_info
        self._check_info = check_info
        self._state = Hs.HELLO
        self._nonce_c = self._nonce_s = b""
        self.peer_info: dict | None = None
        self.reply_on_error: bytes | None = None

    @property
    def state(self) -> Hs:
        """The message expected next (HELLO, AUTH, INFO; REJECT once done)."""
        return self._state

    def on_frame(self, kind: Hs, fields: dict) -> tuple[list, bool]:
        if kind != self._state:
            raise ProtocolError(f"handshake expected {self._state.name}, got {kind.name}")
        if kind == Hs.HELLO:
            self._nonce_c, self._nonce_s = fields["nonce"], AGENT_CHALLENGE.new_nonce()
            self._state = Hs.AUTH
            return [encode(Hs.CHALLENGE, nonce=self._nonce_s)], False
        if kind == Hs.AUTH:
            expected = AGENT_CHALLENGE.client_mac(self._secret, self._nonce_s, self._nonce_c)
            if not AGENT_CHALLENGE.verify(expected, fields["mac"]):
                self.reply_on_error = encode(Hs.AUTH_FAIL)
                raise AuthenticationError("client failed the challenge")
            self._state = Hs.INFO
            mac = AGENT_CHALLENGE.server_mac(self._secret, self._nonce_c, self._nonce_s)
            return [encode(Hs.AUTH_OK, mac=mac)], False
        # INFO: the client is authenticated; only now do keys and layouts flow
        try:
            self._check_info(fields)
        except LayoutMismatch as exc:
            self.reply_on_error = encode(Hs.REJECT, code="layout", reason=str(exc)[:200])
            raise
        self.peer_info = fields
        self._state = Hs.REJECT  # nothing more is expected from the handshake
        return [encode(Hs.INFO, **self._make_info())], True


# ---- pre-auth admission ---------------------------------------------------------
class HandshakeGate:
    """The pending (unauthenticated) connections, oldest first per source. An entry is
    any object with a ``source`` (address) and a ``said_hello`` (bool) attribute."""

    def __init__(self, max_pending: int = MAX_PENDING_HANDSHAKES,
                 max_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.total = 0
        self._pending: dict[str, collections.OrderedDict] = {}  # source -> {entry: None}, oldest first

    def admit(self, entry) -> list:
        """Give ``entry`` a slot; return the entries evicted for it (the caller closes them)."""
        evicted = []
        mine = self._pending.get(entry.source)
        if mine is not None and len(mine) >= self.max_per_source:
            evicted.append(self._evict(entry.source))
        if self.total >= self.max_pending:
            evicted.append(self._evict(max(self._pending, key=lambda s: len(self._pending[s]))))
        self._pending.setdefault(entry.source, collections.OrderedDict())[entry] = None
        self.total += 1
        return evicted

    def release(self, entry) -> bool:
        """Free ``entry``'s slot (it authenticated, failed or closed); False if it held none."""
        mine = self._pending.get(entry.source)
        if mine is None or mine.pop(entry, False) is False:
            return False
        self.total -= 1
        if not mine:
            del self._pending[entry.source]
        return True

    def pending(self, source: str) -> list:
        """The pending entries of ``source``, oldest first."""
        return list(self._pending.get(source, ()))

    def entries(self) -> list:
        """Every pending entry (oldest first per source): for a listener that sweeps
        expired handshakes instead of timing each one."""
        return [e for mine in self._pending.values() for e in mine]

    def _evict(self, source: str):
        mine = self._pending[source]
        victim = next((e for e in mine if not e.said_hello), None)
        if victim is None:
            victim = next(iter(mine))
        self.release(victim)
        return victim
