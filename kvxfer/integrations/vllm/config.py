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
- ``layerwise``: P ships each layer of a remote-decode request's KV as the forward
  writes it (``save_kv_layer``), so the transfer overlaps the prefill, instead of the
  whole request after it (default false; a request's ``kv_transfer_params["layerwise"]``
  overrides it);
- ``idle_wait_ms``: in a step that schedules no tokens while transfers are in flight,
  the worker sleeps up to this long for one to end (woken at once when one does)
  instead of returning into the engine's next empty step (default 5; 0: never).
  vLLM keeps stepping while P lends blocks or D waits for a load; without the
  sleep both engines spin a core each, which the copy threads need;
- ``store``: the KV pool (:class:`kvxfer.KVStore`) this engine reads and fills: an
  ``"etcd://HOST:PORT[/prefix]"`` URL, or store nodes as a list of ``"HOST:PORT"`` (or one
  comma-separated string). Required for ``kv_role`` ``kv_both`` (a plain engine with a
  pool); optional for P and D;
- ``store_salt``: extra bytes (a string) of model identity mixed into the pool's keys,
  e.g. a weights digest (default ``""``: the model's name or path and revision, dtype,
  layer, kv-head and head-size counts, block size and CPU kernel path already are);
- ``store_put_blocks``: blocks whose put into the pool may be in flight at once
  (default 1024); blocks computed beyond that are dropped, not queued (counted);
- ``store_timeout``: seconds a store node may take to answer one request (default 2).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...secrets import MIN_SECRET_BYTES, SECRET_ENV, load_secret, normalize_secret


@dataclass(frozen=True)
class ConnectorConfig:
    role: str  # "producer" (P) or "consumer" (D)
    listen: str = "127.0.0.1:0"
    secret: bytes = b""
    lease_timeout: float = 30.0
    recv_timeout: float = 30.0
    path: str = "auto"
    idle_wait_ms: float = 5.0
    layerwise: bool = False
    store: tuple | str | None = None  # an etcd URL, or a tuple of "HOST:PORT"
    store_salt: str = ""
    store_put_blocks: int = 1024
    store_timeout: float = 2.0

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer", "both"):
            raise ValueError("KVXferConnector needs kv_role kv_producer, kv_consumer or kv_both (with a store), "
                             f"got {self.role!r}")
        if self.role == "both" and self.store is None:
            raise ValueError("kv_role kv_both needs kv_connector_extra_config['store'] (the KV pool)")
        if isinstance(self.store, str) and not self.store.startswith("etcd://"):
            raise ValueError(f"store must be an etcd:// URL or a list of HOST:PORT, got {self.store!r}")
        if isinstance(self.store, tuple) and not self.store:
            raise ValueError("store names no node")
        if not 1 <= self.store_put_blocks <= 1 << 20:
            raise ValueError(f"store_put_blocks must be in [1, 2**20], got {self.store_put_blocks!r}")
        if not self.store_timeout > 0:
            raise ValueError(f"store_timeout must be > 0, got {self.store_timeout!r}")
        try:
            normalize_secret(self.secret)
        except (TypeError, ValueError):
            raise ValueError(f"KVXferConnector needs a secret of >= {MIN_SECRET_BYTES} bytes: "
                             f"kv_connector_extra_config['secret'] or ${SECRET_ENV}") from None
        if not self.lease_timeout > 0 or not self.recv_timeout > 0:
            raise ValueError("lease_timeout and recv_timeout must be > 0")
        if self.path not in ("auto", "zero_copy", "pack"):
            raise ValueError(f"path must be auto, zero_copy or pack, got {self.path!r}")
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be true or false, got {self.layerwise!r}")
        if not 0 <= self.idle_wait_ms <= 1000:
            raise ValueError(f"idle_wait_ms must be in [0, 1000], got {self.idle_wait_ms!r}")

    @classmethod
    def from_vllm(cls, kv_transfer_config, environ=os.environ) -> "ConnectorConfig":
        """Build from a vLLM ``KVTransferConfig`` (``kv_role``, ``kv_connector_extra_config``)."""
        role = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}.get(
            kv_transfer_config.kv_role, kv_transfer_config.kv_role)
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        unknown = set(extra) - {"listen", "secret", "lease_timeout", "recv_timeout", "path",
                                "idle_wait_ms", "layerwise", "store", "store_salt", "store_put_blocks", "store_timeout"}
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys for KVXferConnector: {sorted(unknown)}")
        try:
            secret = load_secret(default=extra.get("secret"), environ=environ)
        except (TypeError, ValueError):
            secret = b""  # absent or short: __post_init__ says where it belongs
        return cls(role=role, listen=str(extra.get("listen", "127.0.0.1:0")), secret=secret,
                   lease_timeout=float(extra.get("lease_timeout", 30.0)),
                   recv_timeout=float(extra.get("recv_timeout", 30.0)),
                   path=str(extra.get("path", "auto")),
                   idle_wait_ms=float(extra.get("idle_wait_ms", 5.0)),
                   layerwise=extra.get("layerwise", False),
                   store=_store_spec(extra.get("store")), store_salt=str(extra.get("store_salt", "")),
                   store_put_blocks=int(extra.get("store_put_blocks", 1024)),
                   store_timeout=float(extra.get("store_timeout", 2.0)))


def _store_spec(value):
    """``store`` as given -> an etcd URL (str), a tuple of node addresses, or None."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if value.startswith("etcd://"):
            return value
        return tuple(a.strip() for a in value.split(",") if a.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise ValueError(f"store must be an etcd:// URL or a list of HOST:PORT strings, got {value!r}")
