"""The connector's settings, read once from vLLM's ``kv_transfer_config``.

``kv_connector_extra_config`` keys (all optional except a secret):

- ``listen``: ``"HOST:PORT"`` of this engine's kvxfer agent (default ``127.0.0.1:0``;
  D connects to P's address, which P hands to D inside ``kv_transfer_params``);
- ``secret``: the deployment's shared secret (>= 16 bytes), or set it in the
  environment variable :data:`SECRET_ENV` (``KVXFER_SECRET``), which wins when
  both are given so the secret need not appear on a command line;
- ``lease_timeout``: seconds P holds a finished request's blocks for D (default 30);
- ``recv_timeout``: seconds D waits for a request's KV before failing it (default 30);
- ``path``: ``auto`` | ``zero_copy`` | ``pack`` (default ``auto``);
- ``idle_wait_ms``: in a step that schedules no tokens while transfers are in flight,
  the worker sleeps up to this long for one to end (woken at once when one does)
  instead of returning into the engine's next empty step (default 5; 0: never).
  vLLM keeps stepping while P lends blocks or D waits for a load; without the
  sleep both engines spin a core each, which the copy threads need.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..secrets import MIN_SECRET_BYTES, SECRET_ENV


@dataclass(frozen=True)
class ConnectorConfig:
    role: str  # "producer" (P) or "consumer" (D)
    listen: str = "127.0.0.1:0"
    secret: bytes = b""
    lease_timeout: float = 30.0
    recv_timeout: float = 30.0
    path: str = "auto"
    idle_wait_ms: float = 5.0

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer"):
            raise ValueError(f"KVXferConnector needs kv_role kv_producer or kv_consumer, got {self.role!r}")
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"KVXferConnector needs a secret of >= {MIN_SECRET_BYTES} bytes: "
                             f"kv_connector_extra_config['secret'] or ${SECRET_ENV}")
        if not self.lease_timeout > 0 or not self.recv_timeout > 0:
            raise ValueError("lease_timeout and recv_timeout must be > 0")
        if self.path not in ("auto", "zero_copy", "pack"):
            raise ValueError(f"path must be auto, zero_copy or pack, got {self.path!r}")
        if not 0 <= self.idle_wait_ms <= 1000:
            raise ValueError(f"idle_wait_ms must be in [0, 1000], got {self.idle_wait_ms!r}")

    @classmethod
    def from_vllm(cls, kv_transfer_config, environ=os.environ) -> "ConnectorConfig":
        """Build from a vLLM ``KVTransferConfig`` (``kv_role``, ``kv_connector_extra_config``)."""
        role = {"kv_producer": "producer", "kv_consumer": "consumer"}.get(kv_transfer_config.kv_role,
                                                                          kv_transfer_config.kv_role)
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        unknown = set(extra) - {"listen", "secret", "lease_timeout", "recv_timeout", "path",
                           "idle_wait_ms"}
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys for KVXferConnector: {sorted(unknown)}")
        secret = environ.get(SECRET_ENV) or extra.get("secret") or ""
        return cls(role=role, listen=str(extra.get("listen", "127.0.0.1:0")),
                   secret=secret.encode() if isinstance(secret, str) else bytes(secret),
                   lease_timeout=float(extra.get("lease_timeout", 30.0)),
                   recv_timeout=float(extra.get("recv_timeout", 30.0)),
                   path=str(extra.get("path", "auto")),
                   idle_wait_ms=float(extra.get("idle_wait_ms", 5.0)))
