"""The deployment's shared secret: its minimum length, where deployments keep it, its checks.

Every agent of a deployment (and its store nodes and serving workers) proves the
same secret in the handshake (:mod:`kvxfer.auth`); it never leaves
the process. Public: entry points (CLI, serving workers, the vLLM connector) load
it with :func:`load_secret` -- a secret file, else :data:`SECRET_ENV` -- the one
place that reads it; :func:`normalize_secret` checks a secret given in code.
"""
from __future__ import annotations

import os

__all__ = ["MIN_SECRET_BYTES", "SECRET_ENV", "has_secret", "load_secret", "normalize_secret"]

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


def load_secret(secret_file: str | None = None, *, default=None, environ=None, remove: bool = False) -> bytes:
    """The deployment's shared secret: the contents of ``secret_file`` (surrounding
    whitespace stripped), else ``$KVXFER_SECRET`` (text) in ``environ`` (default:
    ``os.environ``), else ``default``; checked with :func:`normalize_secret`.

    ``remove``: take the variable out of ``environ`` once read, so processes started
    later do not inherit it. ValueError if none is set or the secret is too short,
    OSError if ``secret_file`` cannot be read.
    """
    environ = os.environ if environ is None else environ
    if secret_file:
        with open(secret_file, "rb") as f:
            secret = f.read().strip()
    elif environ.get(SECRET_ENV):
        secret = environ.pop(SECRET_ENV) if remove else environ[SECRET_ENV]
    elif default:
        secret = default
    else:
        raise ValueError(f"no shared secret: set ${SECRET_ENV} or give a secret file")
    return normalize_secret(secret)


def has_secret(secret_file: str | None = None, *, environ=None) -> bool:
    """Whether :func:`load_secret` has a source to read (``secret_file`` named, or
    ``$KVXFER_SECRET`` set); reads no file and checks no length, so a configuration
    can say early that the secret is missing."""
    environ = os.environ if environ is None else environ
    return bool(secret_file or environ.get(SECRET_ENV))
