"""Mutual challenge-response over a shared secret (HMAC-SHA256).

Sequence (C connects, S accepts)::

    C -> S  HELLO     nonce_c                     (fresh 32 random bytes)
    S -> C  CHALLENGE nonce_s
    C -> S  AUTH      HMAC(secret, "kvxfer-C" | nonce_s | nonce_c)
    S -> C  AUTH_OK   HMAC(secret, "kvxfer-S" | nonce_c | nonce_s)   or AUTH_FAIL, close
    C <-> S INFO      name, layout geometry, backend metadata (keys)

The secret never crosses the wire; both MACs bind both nonces, so neither can be
replayed into another session. S proves itself only after C did, so a client
without the secret gets nothing but a random nonce: no MAC to attack offline,
no layout, no keys. C checks S's proof before it sends its own INFO.
"""
from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 32


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_mac(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, b"kvxfer-C" + nonce_s + nonce_c, hashlib.sha256).digest()


def server_mac(secret: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(secret, b"kvxfer-S" + nonce_c + nonce_s, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


MIN_SECRET_BYTES = 16
SECRET_ENV = "KVXFER_SECRET"  # where deployments put the shared secret (text): worker, serve, vLLM


def normalize_secret(secret) -> bytes:
    """Accept ``bytes`` or ``str`` of at least :data:`MIN_SECRET_BYTES` bytes (ValueError
    if shorter, TypeError if neither); e.g. ``secrets.token_bytes(32)``."""
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError("secret must be bytes or str")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)
