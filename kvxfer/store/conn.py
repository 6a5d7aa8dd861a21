"""A client's connection to one store node: the handshake, then request/reply.

:meth:`NodeConn.open` authenticates with the agents' handshake
(:func:`kvxfer.auth.client_handshake`) and connects the client's backend
to the node's memory (the metadata arrives only after both sides proved the secret).
On the same host (the backend's ``"vm"`` path) it also maps the node's slots
(``slots_local``; 0 elsewhere) and :class:`~kvxfer.store.key_table.KeyTable` (``table``;
None elsewhere), which lookups read instead of asking. Requests are synchronous per
connection (``lock`` held by the caller); a node that does not answer within
``timeout`` or drops the connection raises
:class:`~kvxfer.errors.TransferTimeout` / :class:`~kvxfer.errors.PeerDisconnected`,
and the connection is closed (the client marks the node down).
"""
from __future__ import annotations

import itertools
import json
import select
import socket
import threading
import uuid

from ..framing import HEADER, parse_header
from ..net import open_authenticated
from ..errors import (InvalidDescriptor, KVXferError, LimitExceeded, PeerDisconnected, ProtocolError,
                      TransferTimeout)
from .key_table import KeyTable
from .protocol import CLIENT_INFO, MAX_REQUEST_BYTES, REPLY, STORE_INFO, encode

__all__ = ["NodeConn", "NodeError"]


class NodeError(KVXferError):
    """A node refused one request (the reply's ``error`` code is :attr:`code`)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"store node refused the request: {code}: {reason}")
        self.code = code


class NodeConn:
    """An authenticated connection to the node at ``address`` (see the module doc)."""

    def __init__(self, address: str, sock: socket.socket, backend, bconn, info: dict) -> None:
        self.address = address
        self.lock = threading.Lock()
        self._sock, self._backend, self.bconn = sock, backend, bconn
        self.slot_bytes = int(info["slot_bytes"])
        regions = bconn.remote_regions
        self.region = info["slots_region"]
        self.num_slots = int(info["num_slots"])  # objects of slot_bytes (the largest) the region holds
        self.region_bytes = int(info["region_bytes"])
        # spare chunks the node holds for this client (same host; used and kept by the
        # client's worker under `lock`): [(offset, token, use_by)], all for objects of
        # spare_nbytes, and how many to keep
        self.spares: list = []
        self.spare_nbytes = 0
        self.spares_wanted = 0
        self.spare_slots = True  # False once the node refused a SPARE request (it knows none)
        self.spares_dry = False  # the node's last SPARE answer gave fewer than asked (no free chunks)
        table = info["key_table"]
        if len(regions) != 2 or self.region not in regions or table["region"] not in regions \
                or table["region"] == self.region:
            raise ProtocolError(f"store node {address} advertised regions {sorted(regions)}, not its slots "
                                f"and its key table")
        if regions[self.region][1] < self.region_bytes:
            raise ProtocolError(f"store node {address} advertised a region smaller than its slots")
        # same host (vm path): lookups read the node's key table where it is mapped here
        self.table: KeyTable | None = None
        self.mapped_lock = threading.Lock()  # held while the node's mapped memory is touched; close() unmaps it
        shared = getattr(bconn, "shared_addrs", {})
        self.slots_local = int(shared.get(self.region, 0))  # the slots' first byte mapped here (0: not mapped)
        local = shared.get(table["region"], 0)
        if local and regions[table["region"]][1] >= KeyTable.nbytes(table["buckets"]):
            self.table = KeyTable(int(local), table["buckets"])
            self._quiet = select.poll()  # the socket with nothing to read: no reply due, no EOF
            self._quiet.register(sock, select.POLLIN | select.POLLPRI)
        # other hosts (and same-host clients without the vm path): lookups go as one backend
        # message the node's backend answers from its key table; False once refused
        self.remote_lookups = bconn.transport != "vm"
        self._ids = itertools.count(1)
        self._rbuf = bytearray()
        self.closed = False

    @classmethod
    def open(cls, address: str, secret: bytes, backend, timeout: float, *, client_id: str | None = None) -> "NodeConn":
        """Connect and authenticate; ``client_id``: the identity the node's quotas count this
        connection under (a client's connections share it; default: one of its own)."""
        info = {"name": "kvxfer-store-client", "agent_id": client_id or uuid.uuid4().hex, "backend": b"", "staging": 0,
                "layout": {"kind": CLIENT_INFO}}
        seen: dict = {}

        def check(fields: dict) -> None:
            lay = fields["layout"]
            if lay.get("kind") != STORE_INFO:
                raise ProtocolError(f"{address} is not a kvxfer store node")
            def count(v, least: int) -> bool:
                return not isinstance(v, bool) and isinstance(v, int) and v >= least

            for k, least in (("slot_bytes", 1), ("num_slots", 1), ("slots_region", 0), ("region_bytes", 1)):
                if not count(lay.get(k), least):
                    raise ProtocolError(f"store node {address} sent a bad {k}")
            kt = lay.get("key_table")
            if not isinstance(kt, dict) or not count(kt.get("region"), 0) or not count(kt.get("buckets"), 1) \
                    or kt["buckets"] & (kt["buckets"] - 1) or kt["buckets"] > 1 << 30:
                raise ProtocolError(f"store node {address} sent a bad key_table")
            seen.update(lay)

        sock, fields = open_authenticated(address, secret, info, check, timeout, what="store node ")
        try:
            bconn = backend.connect(fields["backend"])
        except BaseException:
            sock.close()
            raise
        try:
            return cls(address, sock, backend, bconn, seen)
        except BaseException:
            backend.disconnect(bconn)
            sock.close()
            raise

    def spares_of(self, nbytes: int) -> None:
        """The spares to hold are chunks for objects of ``nbytes`` (a size class): those
        held for another size are given up (they lapse on the node)."""
        if self.spare_nbytes != nbytes:
            self.spares, self.spare_nbytes = [], nbytes

    def table_usable(self) -> bool:
        """The key table may be read now (caller holds ``mapped_lock``): mapped, fresh, and
        the socket quiet (a node that died has closed it; a reply due to another thread
        also makes it loud, and that lookup asks instead)."""
        return self.table is not None and not self._quiet.poll(0) and self.table.is_fresh()

    # ---- requests (caller holds self.lock) ----------------------------------------------
    def send(self, msg_type: int, fields: dict, *, reply: bool = True) -> int:
        """Send one request; return its id (0 when no reply comes: RELEASE)."""
        rid = next(self._ids) if reply else 0
        frame = encode(msg_type, {"id": rid, **fields})
        try:
            self._sock.sendall(frame)
        except socket.timeout:
            self.close()
            raise TransferTimeout(f"store node {self.address} did not take a request in time") from None
        except OSError as exc:
            self.close()
            raise PeerDisconnected(f"store node {self.address} went away: {exc}") from None
        return rid

    def recv(self, rid: int, timeout: float) -> dict:
        """The reply to request ``rid`` (raises :class:`NodeError` for an error reply)."""
        try:
            self._sock.settimeout(timeout)
            header = self._read(HEADER.size)
            msg_type, length = parse_header(header, MAX_REQUEST_BYTES)
            payload = self._read(length)
        except socket.timeout:
            self.close()
            raise TransferTimeout(f"store node {self.address} did not answer within {timeout} s") from None
        except (OSError, ConnectionError) as exc:
            self.close()
            raise PeerDisconnected(f"store node {self.address} went away: {exc}") from None
        except ProtocolError:
            self.close()
            raise
        try:
            obj = json.loads(payload)
        except ValueError:
            self.close()
            raise ProtocolError(f"store node {self.address} sent a reply that is not JSON") from None
        if msg_type != REPLY or not isinstance(obj, dict) or obj.get("id") != rid:
            self.close()
            raise ProtocolError(f"store node {self.address} sent an unexpected reply")
        if "error" in obj:
            if obj["error"] == "limit":
                raise LimitExceeded(str(obj.get("reason")))
            raise NodeError(str(obj["error"]), str(obj.get("reason")))
        return obj

    def request(self, msg_type: int, fields: dict, timeout: float) -> dict:
        return self.recv(self.send(msg_type, fields), timeout)

    def _read(self, n: int) -> bytes:
        while len(self._rbuf) < n:
            chunk = self._sock.recv(max(1 << 16, n - len(self._rbuf)))
            if not chunk:
                raise ConnectionError("connection closed")
            self._rbuf += chunk
        out = bytes(self._rbuf[:n])
        del self._rbuf[:n]
        return out

    # ---- data (one-sided) ------------------------------------------------------------------
    def move(self, op: str, descs, timeout: float) -> None:
        """Post ``descs`` (``[n, 5]``: staging region, offset, node region, offset, length)
        and wait until complete (``write``: visible in the node's slots)."""
        self.wait(self.post(op, descs), timeout)

    def post(self, op: str, descs) -> int:
        """Post ``descs`` as :meth:`move` does, without waiting; returns the request for
        :meth:`wait`. Several may be in flight on one connection."""
        if self.closed:
            raise PeerDisconnected(f"store node {self.address} connection is closed")
        try:
            return self._backend.post(self.bconn, op, descs)
        except KVXferError:
            self.close()
            raise

    def wait(self, req: int, timeout: float) -> None:
        """Wait until the posted ``req`` is complete. A failure closes the connection,
        which ends every request still in flight on it."""
        try:
            self._backend.wait(req, timeout)
        except KVXferError:
            self.close()
            raise

    # ---- lookups the node's backend answers (other hosts) --------------------------------
    def post_lookup(self, keys: list) -> int:
        """Send ``keys`` (bytes) to the node's backend, which answers from the node's key
        table (csrc/remote_lookup.cpp); returns the request for :meth:`lookup_result`."""
        if self.closed:
            raise PeerDisconnected(f"store node {self.address} connection is closed")
        try:
            return self._backend.post_lookup(self.bconn, keys)
        except (PeerDisconnected, TransferTimeout):
            self.close()
            raise

    def lookup_result(self, req: int, timeout: float) -> bytes:
        """Wait for lookup ``req``; one byte a key (:data:`~kvxfer.store.key_table.PRESENT`,
        ``ABSENT`` or ``UNKNOWN``). A refusal (:class:`~kvxfer.errors.InvalidDescriptor`)
        leaves the connection open; any other failure closes it."""
        try:
            self._backend.wait(req, timeout)
        except InvalidDescriptor:
            raise
        except KVXferError:
            self.close()
            raise
        return self._backend.lookup_result(req)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self.mapped_lock:  # no reader or copy is inside the mapping when it goes
            self.table = None
            self.slots_local = 0
        try:
            self._backend.disconnect(self.bconn)
        except KVXferError:
            pass
        self._sock.close()
