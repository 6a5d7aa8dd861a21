"""The deployment's shared secret: its minimum length, where deployments keep it, its checks.

Every agent of a deployment (and its store nodes and serving workers) proves the
same secret in the handshake (:mod:`kvxfer.agent.handshake`); it never leaves
the process. Public: entry points (CLI, serving workers, the vLLM connector) read
it from :data:`SECRET_ENV` and check it with :func:`normalize_secret`.
"""
from __future__ import annotations

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
