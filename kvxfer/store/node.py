"""``StoreNode``: one node of the KV pool (``kvxfer store`` runs one per process).

It owns one registered host buffer of ``num_slots`` fixed-size slots (a
:func:`kvxfer.shared_empty` pool: same-host clients map it once and copy with
``memcpy``; other hosts reach it through UCX), a :class:`~kvxfer.store.index.SlotIndex`,
the index's committed keys published as a :class:`~kvxfer.store.key_table.KeyTable`
(registered too: same-host clients answer lookups from it, and the backend answers other
hosts' lookups from it inside its progress, csrc/remote_lookup.cpp) and a listening socket.
Clients authenticate with the agents' handshake (:mod:`kvxfer.auth`, the deployment's
shared secret), admitted through the same gate as an agent's listener
(:class:`~kvxfer.auth.HandshakeGate`: pending slots per source and in total, a HELLO
deadline, connections that said nothing evicted first); only then does the node send
its backend metadata (the memory keys). Clients are bounded by the open-file limit
(raised to its hard limit at start); at that limit the node stops accepting until a
connection closes, logging it at most once a second. The bytes of objects never cross the
socket: clients write and read slots one-sided, and the socket carries the requests of
:mod:`kvxfer.store.protocol`.

With a disk tier (``disk=DiskConfig(...)``, :mod:`kvxfer.store.disk`) objects DRAM lets
go are written to disk and read back for gets, and a restarted node serves what its disk
held (:mod:`kvxfer.store.tiers`); a directory that cannot be used (another node's, read-only)
leaves the node serving DRAM only, with the reason in its stats and log.

One I/O thread does everything (accepts, handshakes, requests, lapsed reservations and
pins, driving the backend where a transport needs the target's progress, the disk tier's
completions), so the index needs no lock. Per client the node bounds what it buffers: a request frame of at most
``MAX_REQUEST_BYTES`` (larger ones are skipped and answered with an error), replies
queued up to ``MAX_QUEUED_BYTES`` (past that it stops reading that client until it
drains them), and the index's per-client reservation and pin limits; per client identity
and in total, the :class:`~kvxfer.store.quotas.Quotas` of reservations, spare slots and
queued reply bytes, as fractions of the node.
"""
from __future__ import annotations

import errno
import itertools
import logging
import selectors
import socket
import threading
import time
import uuid

from .. import auth
from ..auth import HandshakeGate, Hs, ServerHandshake
from ..config import HANDSHAKE_TIMEOUT_S, HELLO_DEADLINE_S, PREAUTH_MAX_FRAME
from ..errors import AuthenticationError, KVXferError, LayoutMismatch, ProtocolError
from ..framing import FrameReader
from ..net import raise_fd_limit, split_address
from ..secrets import normalize_secret
from . import index as ix
from .disk import DiskConfig, DiskTier
from .key_table import KeyTable
from .protocol import CLIENT_INFO, REPLY, STORE_INFO, RequestReader, encode, parse_request
from .requests import DEFERRED, HANDLERS, get_reply
from .quotas import Quotas
from .tiers import Tiers

log = logging.getLogger("kvxfer.store")

__all__ = ["StoreNode", "STORE_INFO", "CLIENT_INFO"]

MAX_QUEUED_BYTES = 8 << 20
MAX_CLIENTS = 1024  # at most; less where the open-file limit is lower (FD_RESERVE kept back)
FD_RESERVE = 64  # open files kept for the node's own use (disk, journal, backend, logs)
_TICK_S = 0.2


class _Client:
    """One connection; until it authenticates, an entry of the node's
    :class:`~kvxfer.auth.HandshakeGate` (``source``, ``said_hello``)."""
    __slots__ = ("sock", "addr", "source", "owner", "hs", "frames", "reader", "out", "deadline", "hello_by",
                 "events", "backlog", "waiting")

    def __init__(self, sock, addr, owner: int, hs: ServerHandshake) -> None:
        self.sock, self.addr, self.owner, self.hs = sock, addr, owner, hs
        self.source = str(addr[0]) if isinstance(addr, tuple) else str(addr)
        self.frames = FrameReader(max_payload=PREAUTH_MAX_FRAME)  # handshake frames, small until authenticated
        self.reader: RequestReader | None = None  # set once authenticated
        self.out = bytearray()
        now = time.monotonic()
        self.deadline = now + HANDSHAKE_TIMEOUT_S
        self.hello_by = now + HELLO_DEADLINE_S
        self.events = selectors.EVENT_READ
        self.backlog: list = []  # frames read but not served yet (replies queued past the limit)
        self.waiting = None  # a GET whose reply waits for disk reads: nothing after it is served meanwhile

    @property
    def said_hello(self) -> bool:
        return self.hs.state != Hs.HELLO


class StoreNode:
    """``StoreNode(listen, capacity_bytes, *, secret, slot_bytes=2 MiB, ...)``; see the module doc.

    ``capacity_bytes`` is rounded down to whole slots (at least one). ``high_watermark``:
    the fraction of slots in use above which LRU objects are evicted. ``lease_s``: how
    long a reservation may stay uncommitted and a pin unreleased before the node takes
    it back. ``backend``: as for :class:`kvxfer.Agent` (``"auto"``, ``"ucx"``, ``"vm"``).
    ``disk``: a :class:`~kvxfer.store.disk.DiskConfig` for a disk tier (None: DRAM only).
    ``require_checksums``: refuse objects committed without a checksum (clients with
    ``checksum=False``; their keys are skipped) rather than hold bytes no reader can verify.
    ``quotas``: a :class:`~kvxfer.store.quotas.Quotas`, what one client and all clients
    together may hold (reservations, spare slots, reply bytes; default ``Quotas()``);
    ``max_queued_bytes`` lowers its per-client reply bound.
    Starts serving at once; :meth:`close` stops (idempotent; with a disk tier, it first
    writes DRAM's objects to disk for up to ``disk.flush_s``).
    """

    def __init__(self, listen: str, capacity_bytes: int, *, secret, slot_bytes: int = 2 << 20,
                 high_watermark: float = 0.98, lease_s: float = 30.0, backend: str = "auto",
                 name: str | None = None, max_queued_bytes: int = MAX_QUEUED_BYTES,
                 disk: DiskConfig | None = None, require_checksums: bool = False,
                 quotas: Quotas | None = None) -> None:
        import kvxfer
        from ..transport import make_backend

        for label, value in (("capacity_bytes", capacity_bytes), ("slot_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int, got {type(value).__name__}")
        if slot_bytes < 1 or capacity_bytes < slot_bytes:
            raise ValueError(f"capacity ({capacity_bytes} B) must hold at least one slot of {slot_bytes} B")
        if disk is not None and not isinstance(disk, DiskConfig):
            raise TypeError(f"disk must be a kvxfer.store.disk.DiskConfig, got {type(disk).__name__}")
        if quotas is not None and not isinstance(quotas, Quotas):
            raise TypeError(f"quotas must be a kvxfer.store.quotas.Quotas, got {type(quotas).__name__}")
        self.quotas = quotas = quotas if quotas is not None else Quotas()
        self._secret = normalize_secret(secret)
        num_slots = capacity_bytes // slot_bytes
        # the key table covers both tiers: at least a bucket per largest object either holds
        nbuckets = KeyTable.buckets_for(num_slots + (disk.capacity_bytes // slot_bytes if disk else 0))
        self._keys_buffer = kvxfer.shared_empty(KeyTable.nbytes(nbuckets))  # uint8 [table bytes]
        self.keys = KeyTable(self._keys_buffer.data_ptr(), nbuckets)
        self.keys.init()
        self.index = ix.SlotIndex(capacity_bytes, slot_bytes, high_watermark=high_watermark, mirror=self.keys,
                                  quotas=quotas)
        self.disk_config, self.disk_error = disk, ""
        self.lease_s = float(lease_s)
        self.require_checksums = bool(require_checksums)
        self.max_queued_bytes = min(int(max_queued_bytes), quotas.client_replies)
        self.queued_peak = 0  # the most reply bytes ever queued for one client
        # reply bytes queued for every client (exact at each tick, counted up as replies are
        # queued between ticks: never below the truth), and the most seen
        self.queued_total = self.queued_total_peak = 0
        self.node_id = uuid.uuid4().hex
        host, port = split_address(listen)
        self.buffer = kvxfer.shared_empty(self.index.region_bytes)  # uint8 [region_bytes]: the chunks
        queue = (disk.queue_bytes if disk and disk.queue_bytes is not None
                 else min(self.index.region_bytes // 16, 512 << 20))
        self.tiers = Tiers(self.index, self.buffer.data_ptr(), self.keys, self._open_disk(disk, slot_bytes),
                           queue_bytes=queue, promote_timeout_s=disk.promote_timeout_s if disk else 1.0)
        if self.tiers.disk is not None:  # twice the write-back queue is kept free: for the writes in
            # flight, and for the puts that come meanwhile
            self.index.watermark = max(1, min(self.index.watermark, self.index.region_bytes - 2 * queue))
        self._backend = make_backend(backend, listen_host=host)
        try:
            self._region = self._backend.register_tensor(self.buffer)
            self._keys_region = self._backend.register_tensor(self._keys_buffer)
            # clients on other hosts ask the table through the backend (answered in its progress)
            self._backend.serve_key_table(self.keys.base, self.keys.nbuckets)
            self._lsock = socket.create_server((host, port), backlog=128)
            self.max_clients = max(1, min(MAX_CLIENTS, raise_fd_limit() - FD_RESERVE))
        except BaseException:
            self._backend.close()
            self.tiers.close()
            raise
        self._lsock.setblocking(False)
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self.name = name or f"store@{self.address}"
        self._meta = self._backend.metadata()
        self._owners = itertools.count(1)
        self._clients: dict[int, _Client] = {}
        self._gate = HandshakeGate()
        self._accepting = True  # False while at the client or open-file limit
        self._resume_at = 0.0
        self._full_logged = 0.0
        self.num_requests = self.num_bad_requests = self.num_auth_failures = 0
        self.num_evicted = self.num_full = 0  # pending connections the gate evicted; pauses at a limit
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        fd = self._backend.event_fd()
        if fd is not None:
            self._sel.register(fd, selectors.EVENT_READ, "backend")
        self.waiting_gets: list = []  # GETs whose replies wait for disk reads (tiers.PendingGet)
        if self.tiers.disk is not None:
            self._sel.register(self.tiers.disk.file.event_fd, selectors.EVENT_READ, "disk")
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-store-{self.address}", daemon=True)
        self._thread.start()

    def _open_disk(self, disk: DiskConfig | None, slot_bytes: int) -> DiskTier | None:
        if disk is None:
            return None
        try:
            tier = DiskTier(disk.path, disk.capacity_bytes, slot_bytes, threads=disk.threads, sync=disk.sync,
                            direct=disk.direct)
        except (OSError, ValueError) as exc:
            log.error("store node: the disk tier at %s cannot be used (%s): serving DRAM only", disk.path, exc)
            self.disk_error = str(exc)
            return None
        if not tier.file.direct:
            log.warning("disk tier %s: the file system refuses O_DIRECT: buffered I/O", tier.path)
        return tier

    # ---- lifecycle -------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the I/O thread (waiting for the handler it runs, however long: nothing below
        may race it), close every client, write DRAM to the disk tier (if any, within its
        ``flush_s``), release the buffer's registration."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        while self._thread.is_alive():  # its handlers never block: it ends after the one running
            log.warning("store node %s: the I/O thread is still in a handler after %.0f s; waiting for it",
                        self.name, timeout)
            self._thread.join(timeout)
        self.keys.beat(alive=False)  # same-host clients stop reading the key table now
        for c in list(self._clients.values()):
            self._drop(c)
        if self.disk_config is not None:
            self.tiers.flush(self.disk_config.flush_s)
        self.tiers.close()
        self._sel.close()
        self._lsock.close()
        self._backend.close()

    def __enter__(self) -> "StoreNode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """The index's counters (see :meth:`SlotIndex.stats`) plus this node's (a snapshot
        read without the I/O thread's cooperation: counts may be a step apart)."""
        disk_state = {} if self.tiers.disk is not None or self.disk_config is None else {
            "disk_state": "unavailable", "disk_error": self.disk_error}
        return {**self.index.stats(), **self.tiers.stats(), **disk_state, "name": self.name, "address": self.address,
                "clients": sum(1 for c in self._clients.values() if c.reader is not None),
                "requests": self.num_requests, "bad_requests": self.num_bad_requests,
                "queued_peak_bytes": self.queued_peak, "queued_total_peak_bytes": self.queued_total_peak,
                "key_table_overflows": self.keys.num_overflows,
                "lookups_answered_by_backend": int(getattr(self._backend, "num_lookups", 0)),
                "auth_failures": self.num_auth_failures, "handshakes_pending": self._gate.total,
                "handshakes_evicted": self.num_evicted, "accept_pauses": self.num_full,
                "max_clients": self.max_clients}

    # ---- the I/O thread --------------------------------------------------------------
    def _run(self) -> None:
        next_tick = time.monotonic() + _TICK_S
        while not self._stop.is_set():
            timeout = max(0.0, next_tick - time.monotonic())
            for key, events in self._sel.select(timeout):
                try:
                    if key.data is None:
                        self._accept()
                    elif key.data == "backend":
                        self._drive_backend()
                    elif key.data == "disk":
                        self.tiers.poll()
                        self._answer_waiting(self.tiers.take_ready())
                    else:
                        self._on_events(key.data, events)
                except Exception:  # noqa: BLE001 - one client's failure must not stop the node
                    log.exception("store node %s: event handling failed", self.name)
                    if isinstance(key.data, _Client):
                        self._drop(key.data)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + _TICK_S
                self.index.expire(now)
                self.tiers.tick(now)
                self._replies_tick()
                self._answer_waiting([w for w in self.waiting_gets if w.deadline <= now])
                if not self._stop.is_set():
                    self.keys.beat()
                for c in self._gate.entries():  # handshakes past their deadlines
                    if c.deadline <= now or (not c.said_hello and c.hello_by <= now):
                        self._drop(c)
                if not self._accepting and now >= self._resume_at:
                    self._resume_accepting()
                self._drive_backend()

    def _drive_backend(self) -> None:
        for _ in range(64):  # bounded: the next select comes back here if work remains
            if self._backend.arm():
                return
            self._backend.progress()

    def _accept(self) -> None:
        """Accept what the backlog holds. Every new connection gets a handshake slot
        (the gate evicts an older pending one for it, one that said nothing first); at
        the client limit or the open-file limit the node stops accepting (the backlog
        waits) until a connection closes or a tick passes."""
        while len(self._clients) < self.max_clients:
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting(f"accept failed: {exc}")
                    return
                raise
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = _Client(sock, addr, next(self._owners), ServerHandshake(self._secret, self._info, self._check_info))
            self._clients[c.owner] = c
            self._sel.register(sock, selectors.EVENT_READ, c)
            for old in self._gate.admit(c):
                self.num_evicted += 1
                self._reject_busy(old, "too many pending handshakes from this source or in total")
        self._pause_accepting(f"{len(self._clients)} clients (its limit)")

    def _pause_accepting(self, why: str) -> None:
        """Stop watching the listening socket until a connection closes or a tick
        passes (no spin on a backlog it cannot take); logged at most once a second."""
        if self._accepting:
            self._accepting = False
            self.num_full += 1
            try:
                self._sel.unregister(self._lsock)
            except (KeyError, ValueError):
                pass
        self._resume_at = time.monotonic() + _TICK_S
        now = time.monotonic()
        if now - self._full_logged >= 1.0:
            self._full_logged = now
            log.warning("store node %s: not accepting for now: %s", self.name, why)

    def _resume_accepting(self) -> None:
        if not self._accepting and not self._stop.is_set() and len(self._clients) < self.max_clients:
            self._accepting = True
            self._sel.register(self._lsock, selectors.EVENT_READ, None)

    def _reject_busy(self, c: _Client, why: str) -> None:
        """A pending connection the gate evicted: REJECT ``busy`` (its client raises
        ConnectionRefused) and close."""
        try:
            c.sock.send(auth.encode(Hs.REJECT, code="busy", reason=why[:200]))
            c.sock.shutdown(socket.SHUT_WR)
            c.sock.recv(4096)  # unread bytes would turn the close into a reset that may overtake the REJECT
        except OSError:
            pass
        self._drop(c)

    def _info(self) -> dict:
        return {"name": self.name, "agent_id": self.node_id, "backend": self._meta, "staging": 0,
                "layout": {"kind": STORE_INFO, "slot_bytes": self.index.slot_bytes,
                           "num_slots": self.index.num_slots, "region_bytes": self.index.region_bytes,
                           "slots_region": self._region,
                           "key_table": {"region": self._keys_region, "buckets": self.keys.nbuckets}}}

    @staticmethod
    def _check_info(fields: dict) -> None:
        if fields["layout"].get("kind") != CLIENT_INFO:
            raise LayoutMismatch("this is a kvxfer store node: connect with kvxfer.KVStore")

    def _on_events(self, c: _Client, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(c)
        if events & selectors.EVENT_READ and c.owner in self._clients:
            try:
                data = c.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._drop(c)
                return
            if c.reader is None:
                self._handshake(c, data)
            else:
                self._requests(c, data)

    def _handshake(self, c: _Client, data: bytes) -> None:
        try:
            for msg_type, payload in c.frames.feed(data):
                frames, ready = c.hs.on_frame(*auth.decode(msg_type, payload))
                for f in frames:
                    c.out += f
                if c.hs.state in (Hs.INFO, Hs.REJECT):  # authenticated: its slot is free, its INFO may be large
                    self._gate.release(c)
                    c.frames.max_payload = 1 << 16
                if ready:
                    c.reader = RequestReader()
                    rest = c.frames.feed(b"")
                    if rest:
                        raise ProtocolError("request sent before the handshake finished")
                    break
        except (KVXferError, ValueError) as exc:
            if c.hs.reply_on_error is not None:
                c.out += c.hs.reply_on_error
            if isinstance(exc, AuthenticationError):
                self.num_auth_failures += 1
            log.info("store node %s: handshake with %s failed: %s", self.name, c.addr, exc)
            self._flush(c)
            self._drop(c)
            return
        self._flush(c)

    def _requests(self, c: _Client, data: bytes) -> None:
        try:
            frames = c.reader.feed(data)
        except ProtocolError as exc:  # the stream itself is broken: only this client goes
            log.info("store node %s: closing %s: %s", self.name, c.addr, exc)
            self._drop(c)
            return
        c.backlog.extend(frames)
        self._serve_backlog(c)
        self._flush(c)

    def _may_reply(self, c: _Client) -> bool:
        """``c``'s next request may be served now: its replies queued are under its bound,
        and either under the node's total or none (a client with nothing queued always
        gets one reply, so the total is exceeded by at most one reply a client)."""
        return len(c.out) < self.max_queued_bytes and (not c.out or self.queued_total < self.quotas.total_replies)

    def _serve_backlog(self, c: _Client) -> None:
        now = time.monotonic()
        served = 0
        while served < len(c.backlog) and c.waiting is None and self._may_reply(c):
            msg_type, payload = c.backlog[served]
            served += 1
            self.num_requests += 1
            reply = self._serve(c, msg_type, payload, now)
            if reply is not None and reply is not DEFERRED:
                frame = encode(REPLY, reply)
                c.out += frame
                self.queued_total += len(frame)
        del c.backlog[:served]
        self.queued_peak = max(self.queued_peak, len(c.out))
        self.queued_total_peak = max(self.queued_total_peak, self.queued_total)

    def _replies_tick(self) -> None:
        """Each tick: the exact reply bytes queued; clients held back by the node's total
        are served again as the others drained."""
        self.queued_total = sum(len(c.out) for c in self._clients.values())
        for c in [c for c in self._clients.values() if c.backlog and c.waiting is None]:
            if self._clients.get(c.owner) is c and self._may_reply(c):
                self._flush(c)

    def _serve(self, c: _Client, msg_type: int, payload, now: float) -> dict | None:
        """One request -> its reply (None: RELEASE, which has none; ``DEFERRED``: a GET whose
        reply waits for disk reads), from the handler of its kind
        (:data:`~kvxfer.store.requests.HANDLERS`)."""
        if payload is None:
            self.num_bad_requests += 1
            return {"id": None, "error": "too_large", "reason": "request frame over the size limit"}
        try:
            kind, rid, f = parse_request(msg_type, payload)
        except ProtocolError as exc:
            self.num_bad_requests += 1
            return {"id": getattr(exc, "request_id", None), "error": "bad_request", "reason": str(exc)[:200]}
        if self.index.identity_of(c.owner) is None:  # its first request: whose quotas it draws on
            peer = c.hs.peer_info or {}
            self.index.identify(c.owner, (str(c.addr[0]) if isinstance(c.addr, tuple) else str(c.addr),
                                          str(peer.get("agent_id", c.owner))[:64]))
        return HANDLERS[kind](self, c, rid, f, now)

    def _answer_waiting(self, ready) -> None:
        """Reply to the GETs in ``ready`` (their disk reads ended, or their time ran out)."""
        now = time.monotonic()
        for w in ready:
            if w not in self.waiting_gets:
                continue
            self.waiting_gets.remove(w)
            c = w.client
            if self._clients.get(c.owner) is c and c.waiting is w:
                c.waiting = None
                c.out += encode(REPLY, get_reply(self, c, w.rid, w.fields, now, w.promoted))
                self._flush(c)
            self.tiers.answered(w)

    def _flush(self, c: _Client) -> None:
        while True:  # send, serve what may be served, until the socket or the bounds say stop
            if c.out:
                try:
                    n = c.sock.send(c.out)
                    del c.out[:n]
                    self.queued_total = max(0, self.queued_total - n)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self._drop(c)
                    return
            if not (c.backlog and self._may_reply(c)):
                break
            before = len(c.backlog)
            self._serve_backlog(c)
            if not c.out or len(c.backlog) == before:
                break
        # bounded per-client queue: while replies pile up unread, read (and serve) no more
        reading = self._may_reply(c) and not c.backlog
        events = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if c.out else 0)
        if events != c.events:
            self._sel.modify(c.sock, events, c)
            c.events = events

    def _drop(self, c: _Client) -> None:
        if self._clients.pop(c.owner, None) is None:
            return
        self._gate.release(c)
        if not self._accepting and len(self._clients) < self.max_clients:
            self._resume_accepting()
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        if c.waiting is not None and c.waiting in self.waiting_gets:
            self.waiting_gets.remove(c.waiting)
            self.tiers.answered(c.waiting)
        self.index.forget_owner(c.owner)

