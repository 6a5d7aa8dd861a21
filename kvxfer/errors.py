"""The one error hierarchy of kvxfer.

Every failure a caller can act on has its own subclass of :class:`KVXferError`.
Argument mistakes (wrong shape, wrong dtype, out-of-range ids) raise the
built-in :class:`ValueError` / :class:`TypeError` instead, before any memory is
touched. The C++ extension maps its statuses onto these classes.
"""
from __future__ import annotations

__all__ = [
    "KVXferError",
    "TransferTimeout",
    "PeerDisconnected",
    "LayoutMismatch",
    "AuthenticationError",
    "RegistrationError",
    "InvalidDescriptor",
    "TransferCancelled",
    "ProtocolError",
    "ConnectionRefused",
    "LimitExceeded",
    "BlocksBusy",
    "StoreMiss",
    "StorePartConflict",
]


class KVXferError(Exception):
    """Base class of every kvxfer failure."""


class TransferTimeout(KVXferError, TimeoutError):
    """A wait ran past its timeout; nothing incomplete was reported as done."""


class PeerDisconnected(KVXferError, ConnectionError):
    """The remote agent went away (process died, connection dropped)."""


class LayoutMismatch(KVXferError):
    """Two KV pools cannot be converted into each other (model dims, dtype, block size)."""


class AuthenticationError(KVXferError):
    """The peer failed the shared-secret challenge; it learned no memory keys."""


class RegistrationError(KVXferError):
    """Memory could not be registered, or a registration is no longer valid."""


class InvalidDescriptor(KVXferError, ValueError):
    """A transfer descriptor falls outside the memory the peer advertised."""


class TransferCancelled(KVXferError):
    """The transfer was cancelled before it completed."""


class ProtocolError(KVXferError):
    """A control message was malformed or of an unsupported protocol version."""


class ConnectionRefused(KVXferError, ConnectionError):
    """The peer's agent refused the connection before it authenticated: it closed this
    pending handshake to admit a newer connection (too many pending, from this address
    or in all), or closed before the handshake began; retry later."""


class LimitExceeded(KVXferError):
    """A per-peer limit (queued notifications, cached posts, staging requests, ...) was hit;
    only the request or peer that exceeded it fails."""


class BlocksBusy(KVXferError):
    """A ``recv`` or ``send`` names blocks another pending transfer of this agent holds
    (a recv's blocks are written: no other transfer may name them; a send's are read:
    other sends may share them, a recv may not). Raised at the call; nothing was
    posted or leased. Retry once the other transfer's lease ended (``on_release``)."""


class StoreMiss(KVXferError):
    """A :meth:`kvxfer.KVStore.get` found some key absent (never put, evicted, its node
    down) or its bytes failed the checksum; ``loaded`` leading blocks hold their KV."""

    def __init__(self, message: str, *, loaded: int = 0) -> None:
        super().__init__(message)
        self.loaded = loaded


class StorePartConflict(KVXferError):
    """A TP rank's :meth:`kvxfer.KVStore.put` found ``keys`` being assembled from parts that
    overlap its heads without equalling them (a group of another TP degree putting the
    same keys now, or two ranks claiming the same heads): those keys were not put by this
    call (the others were). They become readable if the other writer completes them."""

    def __init__(self, message: str, *, keys=()) -> None:
        super().__init__(message)
        self.keys = list(keys)
