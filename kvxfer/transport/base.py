"""The backend interface every data mover implements.

A backend moves bytes between *registered regions*: a region is registered once
(the whole KV pool, the staging ring) and named by a small integer id. A
transfer is a batch of descriptors, an ``int64`` array of shape ``[n, 5]``::

    (local_region_id, local_offset, remote_region_id, remote_offset, length)

Offsets are bytes from the start of the region. Every descriptor is checked
against the local registrations and the regions the peer advertised before
anything is posted (:class:`~kvxfer.errors.InvalidDescriptor` otherwise).

Completion promised by :meth:`Backend.test` / :meth:`Backend.wait` returning
True: for a write, the bytes are visible in the remote region (the backend
flushed); for a read, the bytes are in the local region. Notifications are not
part of the data path: the agent sends them after completion, so a peer that
sees a notification also sees the data.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..errors import KVXferError

LOOKUP_MAX_KEYS = 4096  # keys per Backend.post_lookup (kLookupMaxKeys, csrc/am_batch.h)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; used by the agent's cost model."""

    name: str
    # rough per-descriptor cost, for choosing zero-copy vs pack
    per_desc_overhead_us: float = 1.0


@dataclass
class Connection:
    """A backend's handle to one remote agent's memory (after authentication)."""

    peer_id: int
    transport: str  # what actually carries the bytes, e.g. "vm", "ucx:cma", "ucx:tcp"
    remote_regions: dict = field(default_factory=dict)  # region_id -> (addr, length)


class Backend(ABC):
    """Registration and one-sided data movement. One instance per agent."""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def register(self, addr: int, length: int, *, device: str = "cpu", device_id: int = 0) -> int:
        """Register ``[addr, addr+length)`` once; return its region id."""

    @abstractmethod
    def deregister(self, region_id: int) -> None:
        """Invalidate a region and every key made from it."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer needs to reach this backend's regions (keys included).

        Only ever sent to a peer after it authenticated.
        """

    @abstractmethod
    def connect(self, peer_metadata: bytes) -> Connection:
        """Build a connection from a peer's :meth:`metadata` bytes."""

    @abstractmethod
    def disconnect(self, conn: Connection) -> None: ...

    @abstractmethod
    def post(self, conn: Connection, op: str, descs) -> int:
        """Validate and post a batch (``op`` is ``"write"`` or ``"read"``); return a request id."""

    @abstractmethod
    def test(self, request_id: int) -> bool:
        """Make progress; True once the request completed (data visible, see module doc).

        Raises :class:`~kvxfer.errors.PeerDisconnected` if the peer went away.
        """

    @abstractmethod
    def wait(self, request_id: int, timeout: float) -> None:
        """Block until complete, or raise :class:`~kvxfer.errors.TransferTimeout`."""

    def progress(self) -> int:
        """Drive pending work once without blocking; return how many events were processed.

        Default: nothing to drive (a backend that completes within :meth:`post`)."""
        return 0

    def needs_progress(self, conn: Connection) -> bool:
        """True if this process must keep driving the backend (:meth:`progress`,
        :meth:`arm`) for ``conn``'s peer to complete its transfers into us, e.g. UCX
        emulating RMA over TCP. Default: False."""
        return False

    def event_fd(self) -> int | None:
        """A file descriptor that becomes readable when the backend has work, or None.

        A backend that needs its *target* side driven (UCX emulating RMA over TCP,
        connections to accept or reap) returns one; the owner watches it and calls
        :meth:`arm` whenever it is readable. None: the backend needs no driving.
        """
        return None

    def arm(self) -> bool:
        """Drive pending work, then re-arm :meth:`event_fd`.

        True: armed, sleep until the fd is readable; False: work is still pending,
        call again soon.
        """
        return True

    # -- a store node's key table, asked by peers (kvxfer.store) -----------------
    def serve_key_table(self, base: int, nbuckets: int) -> bool:
        """Answer peers' :meth:`post_lookup` from the key table at ``base``
        (:class:`~kvxfer.store.key_table.KeyTable`, kept mapped until :meth:`close`).
        Returns False where this backend cannot (peers then ask another way)."""
        return False

    def post_lookup(self, conn: Connection, keys: list) -> int:
        """Ask ``conn``'s peer, as it serves its key table, about ``keys`` (bytes, 1..64
        each, 1..:data:`LOOKUP_MAX_KEYS` of them, else ``ValueError``); return a request id
        for :meth:`wait`, then :meth:`lookup_result`. Raises
        :class:`~kvxfer.errors.KVXferError` where this backend or path cannot."""
        raise KVXferError(f"{type(self).__name__} does not carry lookups")

    def lookup_result(self, request_id: int) -> bytes:
        """Per key of a completed :meth:`post_lookup` one byte: 1 present, 0 absent, 2 unknown."""
        raise KVXferError(f"{type(self).__name__} does not carry lookups")

    @abstractmethod
    def close(self) -> None:
        """Release every registration and endpoint; idempotent."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc) -> None:
        """``with make_backend(...) as b:`` closes ``b`` on the way out."""
        self.close()
