"""Peers and their control connections: connect, accept, dispatch, per-peer books.

:class:`Peer` is what :meth:`Agent.connect` returns (and what an accepted
connection becomes once its handshake completed). :class:`Connections` owns the
listening socket's admission (the pre-auth gate), the client and server
handshakes, the set of connected peers (``state.peers``) and the dispatch table
that hands each frame after the handshake to the component that owns it (sender,
receiver, notifications): once a peer is ready, its connection carries that table
(``Conn.dispatch``) and the I/O loop calls the owner's function directly.
:class:`InboundHandler` runs the accepting side's handshake state machine in the
I/O thread; it and :class:`PeerHandler` (connections we opened) see only the
handshake, frames that arrive before the table is set, malformed frames and the
close (through the methods marked *handler interface* only).

Bounds on what connected peers can make this agent hold: every queue or cache a
peer fills is counted against that peer (:class:`PeerBook`, one per
:class:`Peer`) and against the agent's total over all its peers
(:class:`AgentBook`), so a peer that floods fails itself, and many connections
together still cannot exhaust the agent. Caches of hints (unmatched RECV_POSTs,
tombstones of ended requests) drop their oldest entry when full -- at an
agent-wide bound, the oldest entry of the peer holding the most; queues of work
(notifications, staging requests) close the connection of the peer whose message
would exceed a bound with :class:`~kvxfer.errors.LimitExceeded`. A peer's caches
are emptied when it disconnects. The numbers (:class:`~kvxfer.config.PeerLimits`)
are documented in ``docs/api.md`` ("Limits").
"""
from __future__ import annotations

import collections
import itertools
import socket
import sys

from ..config import HELLO_DEADLINE_S, PREAUTH_MAX_FRAME, TOMBSTONE_OVERHEAD, PeerLimits
from ..errors import ConnectionRefused, KVXferError, LimitExceeded, PeerDisconnected, ProtocolError, TransferTimeout
from ..framing import MAX_PAYLOAD
from ..transport.cuda_peer import PeerLink
from .. import auth
from ..auth import Hs, HandshakeGate, ServerHandshake
from ..net import open_authenticated
from .pool import local_info, parse_info
from .protocol import Msg
from .state import AgentState


class Peer:
    """A connected, authenticated remote agent (returned by :meth:`Agent.connect`)."""

    _serials = itertools.count(1)

    def __init__(self, name: str, agent_id: str, address: str | None, info: dict,
                 books: AgentBook | None = None) -> None:
        self.serial = next(Peer._serials)
        self.name = name
        self.agent_id = agent_id
        self.address = address
        self.geometry = info["geometry"]  # kvxfer.transport.descriptors.Geometry, or None (no pool)
        self.region_ids: list = info["regions"]
        self.stage_region: int = info["stage_region"]
        self.staging_bytes: int = info["staging"]
        self.parts: dict = info.get("parts", {})  # its regions registered in several parts
        self.link = PeerLink({}, None, False)  # same-node peer copies (set by Connections.make_peer)
        self.conn = None  # control connection
        self.bconn = None  # backend connection
        self.is_connected = True
        # what this peer makes us hold, bounded per peer and in the agent's total (PeerBook below)
        self.book = (books if books is not None else AgentBook()).open(self.serial)

    @property
    def transport(self) -> str:
        """What actually carries the bytes (e.g. ``vm``, ``ucx:cma``, ``loopback``)."""
        return self.bconn.transport if self.bconn is not None else "none"

    @property
    def device_transport(self) -> str:
        """What carries this pool's pieces to this peer: ``cuda_peer`` where its pool is
        (or can be) mapped here for one-launch copies (:mod:`kvxfer.transport.cuda_peer`),
        else the backend's lane for GPU memory (``ucx:cuda_ipc`` on one host) or
        :attr:`transport` where the backend does not tell them apart."""
        if self.link.usable:
            return "cuda_peer"
        return getattr(self.bconn, "device_transport", self.transport)

    def send(self, frame: bytes, more: bool = False) -> bool:
        return self.is_connected and self.conn.send(frame, more)

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else "disconnected"
        return f"<Peer {self.name!r} {state} transport={self.transport}>"


class PeerHandler:
    """Hands the frames of an authenticated connection to ``conns`` (a Connections)."""

    def __init__(self, conns) -> None:
        self.conns = conns

    def on_frame(self, conn, kind, fields) -> None:
        self.conns.on_frame(conn.peer, kind, fields)

    def on_malformed(self, conn, exc) -> None:
        """A whole frame whose payload did not decode: before authentication it closes
        the connection (raises), after it the connections decide."""
        if conn.peer is None:
            raise exc
        self.conns.on_malformed(conn.peer, exc)

    def on_close(self, conn, exc) -> None:
        self.conns.on_closed(conn.peer, exc)


class InboundHandler(PeerHandler):
    """Runs the server handshake, then behaves as :class:`PeerHandler`. Holds one of the
    agent's pre-auth slots (:class:`~kvxfer.auth.HandshakeGate`) from its accept until it
    authenticates, fails, is evicted or closes."""

    def __init__(self, conns, source: str) -> None:
        super().__init__(conns)
        self.hs = conns.server_handshake()
        self.source = source
        self.conn = None
        self.evicted = False

    @property
    def said_hello(self) -> bool:
        """Its HELLO arrived (the gate evicts connections that said nothing yet first)."""
        return self.hs.state != Hs.HELLO

    def on_open(self, conn) -> None:
        self.conn = conn
        conn.reader.max_payload = PREAUTH_MAX_FRAME

        def expire(what: str, still) -> None:
            if conn.peer is None and not conn.closed and still():
                conn.loop.close_conn(conn, TransferTimeout(f"{what} timed out"))

        conn.loop.call_later(HELLO_DEADLINE_S, lambda: expire("waiting for HELLO", lambda: self.hs.state == Hs.HELLO))
        conn.loop.call_later(self.conns.handshake_timeout, lambda: expire("handshake", lambda: True))

    def evict(self, why: str) -> None:
        """The gate gave this connection's slot to a newer one (I/O thread): REJECT
        ``busy`` and close; frames that still arrive are ignored."""
        self.evicted = True
        conn = self.conn
        if conn is None or conn.closed:
            return
        conn.send(auth.encode(Hs.REJECT, code="busy", reason=why[:200]))
        try:
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.recv(4096)  # unread bytes would turn the close into a reset that may overtake the REJECT
        except OSError:
            pass
        conn.loop.close_conn(conn, ConnectionRefused(why))

    def on_frame(self, conn, kind, fields) -> None:
        if conn.peer is not None:
            return super().on_frame(conn, kind, fields)
        if self.evicted:
            return
        try:
            frames, ready = self.hs.on_frame(kind, fields)
        except KVXferError:
            if self.hs.reply_on_error is not None:
                conn.send(self.hs.reply_on_error)
            raise
        if self.hs.state in (Hs.INFO, Hs.REJECT):  # authenticated: no longer pre-auth, its INFO may be large
            self.conns.release_slot(self, True)
            conn.reader.max_payload = MAX_PAYLOAD
        if ready:
            peer = self.conns.make_peer(self.hs.peer_info, None)
            peer.conn = conn
            conn.peer = peer
        for frame in frames:
            conn.send(frame)
        if ready:
            self.conns.peer_ready(conn.peer)

    def on_close(self, conn, exc) -> None:
        self.conns.release_slot(self, self.evicted)  # not evicted: closed before authenticating
        if conn.peer is not None:
            super().on_close(conn, exc)


# ---- the connections of an agent ------------------------------------------------
class Connections:
    """``handlers``: ``{Msg: fn(peer, fields)}`` after the handshake (built once by the
    agent); ``on_ready(peer)`` runs with the state's lock held once a peer is usable;
    ``on_lost(peer, error)`` once it disconnected; ``driver``: the backend driver;
    ``malformed``: ``{Msg: fn(peer, fields, error)}`` for a per-request message of an
    authenticated peer whose payload did not decode (``fields``: those before the bad
    one), which fails that request only; other malformed messages close the connection."""

    def __init__(self, state: AgentState, secret: bytes, handlers: dict, on_ready, on_lost, driver,
                 malformed: dict | None = None) -> None:
        self._s = state
        self._secret = secret
        self._gate = HandshakeGate()  # pre-auth admission (I/O thread only)
        self.books = AgentBook(state.config.limits)  # what all peers make us hold (lock held)
        self._dispatch = dict(handlers)
        self._malformed = dict(malformed or {})
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._driver = driver

    @property
    def handshake_timeout(self) -> float:
        return self._s.config.handshake_timeout

    # ---- outbound -------------------------------------------------------------------
    def connect(self, address: str, timeout: float) -> Peer:
        self._s.check_open()
        sock, fields = open_authenticated(address, self._secret, local_info(self._s), self.parse_info, timeout)
        try:
            peer = self.make_peer(fields, address)
        except BaseException:
            sock.close()
            raise
        self._s.loop.add_conn(sock, PeerHandler(self), peer)
        self.peer_ready(peer)
        return peer

    # ---- inbound (I/O thread) -------------------------------------------------------
    def on_accept(self, sock, source: str):
        """A new inbound connection: always admitted (None once the agent is closed).
        Pending connections it evicts get REJECT "busy" (their clients raise
        ConnectionRefused) and are closed."""
        if self._s.closed:
            return None
        handler = InboundHandler(self, source)
        for old in self._gate.admit(handler):
            self._s.metrics.inc("evicted_handshakes")
            where = f" from {source}" if old.source == source else ""
            old.evict(f"too many pending handshakes{where}; this one was the oldest")
        return handler

    # ---- handler interface (peers.py) -------------------------------------------------
    def server_handshake(self) -> ServerHandshake:
        return ServerHandshake(self._secret, lambda: local_info(self._s), self.parse_info)

    def release_slot(self, handler, ok: bool) -> None:
        """An inbound connection's pre-auth slot is free (``ok``: it authenticated or was
        evicted; else it failed or closed before authenticating)."""
        if self._gate.release(handler) and not ok:
            self._s.metrics.inc("failed_handshakes")

    def parse_info(self, fields: dict) -> dict:
        return parse_info(self._s, fields)

    def make_peer(self, fields: dict, address: str | None) -> Peer:
        """The authenticated peer of a handshake's INFO ``fields``, with its backend connection."""
        info = self.parse_info(fields)
        with self._s.lock:  # its book joins the agent's
            peer = Peer(fields["name"], fields["agent_id"], address, info, self.books)
            pool = self._s.pool
            if pool is not None:
                peer.link = PeerLink(info["peer"], pool.ipc, self._s.config.peer_copy and info["geometry"] is not None)
        try:
            peer.bconn = self._s.backend.connect(fields["backend"])
        except BaseException:
            with self._s.lock:
                peer.book.close()
            raise
        self._s.metrics.info[f"transport:{peer.name}"] = peer.transport
        self._driver.peer_connected(peer.bconn)
        return peer

    def peer_ready(self, peer: Peer) -> None:
        with self._s.lock:
            if self._s.closed:
                peer.conn.loop.close_conn(peer.conn)
                return
            self._s.peers[peer.serial] = peer
            peer.conn.dispatch = self._dispatch  # from now on the loop hands frames to their owners
            self._on_ready(peer)

    def on_frame(self, peer: Peer, kind: Msg, fields: dict) -> None:
        """A frame that arrived before :meth:`peer_ready` set the connection's dispatch table."""
        handler = self._dispatch.get(kind)
        if handler is None:
            raise ProtocolError(f"unexpected {kind.name} after the handshake")
        handler(peer, fields)

    def on_malformed(self, peer: Peer, exc) -> None:
        handler = self._malformed.get(getattr(exc, "kind", None))
        if handler is None:
            raise exc
        self._s.metrics.inc("malformed_messages", kind=exc.kind.name)
        handler(peer, exc.fields, exc)

    def on_closed(self, peer: Peer, exc) -> None:
        with self._s.lock:
            if not peer.is_connected:
                return
            peer.is_connected = False
            self._s.peers.pop(peer.serial, None)
        self._on_lost(peer, PeerDisconnected(f"peer {peer.name!r} disconnected: {exc}"))
        with self._s.lock:
            peer.book.close()  # its cached posts and tombstones go
        try:
            self._s.backend.disconnect(peer.bconn)
        except KVXferError:
            pass

    # ---- queries ----------------------------------------------------------------------
    def connected(self) -> list:
        with self._s.lock:
            return [p for p in self._s.peers.values() if p.is_connected]

    @staticmethod
    def disconnect(peer: Peer) -> None:
        if peer.conn is not None:
            peer.conn.loop.close_conn(peer.conn, ConnectionError("disconnected locally"))


# ---- books: what peers make this agent hold -------------------------------------
def tombstone_nbytes(req: str, reason: str) -> int:
    """The bytes a tombstone of ``req`` with ``reason`` is counted as."""
    return TOMBSTONE_OVERHEAD + sys.getsizeof(req) + sys.getsizeof(reason)


class _Counts:
    """What a book holds: cached posts and their block ids, tombstones and their bytes,
    undrained notifications and their bytes, outstanding staging requests."""

    def __init__(self) -> None:
        self.num_posts = 0
        self.posted_blocks = 0
        self.num_tombstones = 0
        self.tombstone_bytes = 0
        self.notes = 0
        self.note_bytes = 0
        self.stage_reqs = 0


class AgentBook(_Counts):
    """The totals over every connected peer's book, and those books (guarded by the
    agent state's lock, like every book)."""

    def __init__(self, limits: PeerLimits = PeerLimits()) -> None:
        super().__init__()
        self.limits = limits
        self.books: dict = {}  # peer serial -> PeerBook, of connected peers

    def open(self, serial: int) -> "PeerBook":
        """The book of a new peer (lock held)."""
        book = PeerBook(self, serial)
        self.books[serial] = book
        return book

    def _largest(self, attr: str) -> "PeerBook":
        return max(self.books.values(), key=lambda b: getattr(b, attr))


class PeerBook(_Counts):
    """Counters and bounded caches of one peer, counted in its :class:`AgentBook` too
    (guarded by the agent state's lock). Tombstones keep only what a later send of
    that id needs: ``(xid, code, reason)`` -- a FAIL code (None: cancelled) and at
    most 200 characters of text; never an exception or a block list."""

    MAX_REASON = 200

    def __init__(self, agent: AgentBook | None = None, serial: int = 0) -> None:
        super().__init__()
        self.agent = agent if agent is not None else AgentBook()
        self.limits = self.agent.limits
        self.serial = serial
        self.is_open = True
        self.posts: collections.OrderedDict = collections.OrderedDict()  # req -> num blocks, oldest first
        self.tombstones: collections.OrderedDict = collections.OrderedDict()  # req -> (xid, code, reason, nbytes)

    # ---- unmatched RECV_POSTs (P side) ---------------------------------------------------
    def add_post(self, req: str, num_blocks: int) -> list:
        """Count a cached post; return ``[(peer serial, request id), ...]`` of the older
        posts dropped to make room (of this peer, or of the largest at an agent bound)."""
        self.drop_post(req)
        lim, agent = self.limits, self.agent
        dropped = []
        while self.posts and (self.num_posts >= lim.max_posts
                              or self.posted_blocks + num_blocks > lim.max_posted_blocks):
            dropped.append((self.serial, self._pop_post()))
        while agent.num_posts and agent.num_posts >= lim.max_agent_posts:
            victim = agent._largest("num_posts")
            dropped.append((victim.serial, victim._pop_post()))
        while agent.num_posts and agent.posted_blocks + num_blocks > lim.max_agent_posted_blocks:
            victim = agent._largest("posted_blocks")
            dropped.append((victim.serial, victim._pop_post()))
        self.posts[req] = num_blocks
        self._count_post(1, num_blocks)
        return dropped

    def drop_post(self, req: str) -> None:
        n = self.posts.pop(req, None)
        if n is not None:
            self._count_post(-1, -n)

    def _pop_post(self) -> str:
        req, n = self.posts.popitem(last=False)
        self._count_post(-1, -n)
        return req

    def _count_post(self, posts: int, blocks: int) -> None:
        self.num_posts += posts
        self.posted_blocks += blocks
        if self.is_open:
            self.agent.num_posts += posts
            self.agent.posted_blocks += blocks

    # ---- tombstones (P side) -------------------------------------------------------------
    def bury(self, req: str, xid: int, code: str | None, reason: str) -> None:
        """Remember that the peer ended ``req`` (its attempt ``xid``): with the FAIL ``code``
        (None: cancelled) and ``reason``, for a send of that id that comes later."""
        if not self.is_open:
            return
        self.unbury(req)
        reason = str(reason)[:self.MAX_REASON]
        nbytes = tombstone_nbytes(req, reason)
        self.tombstones[req] = (xid, code, reason, nbytes)
        self._count_tombstone(1, nbytes)
        lim, agent = self.limits, self.agent
        while self.tombstones and (self.num_tombstones > lim.max_tombstones
                                   or self.tombstone_bytes > lim.max_tombstone_bytes):
            self._pop_tombstone()
        while agent.num_tombstones and (agent.num_tombstones > lim.max_agent_tombstones
                                        or agent.tombstone_bytes > lim.max_agent_tombstone_bytes):
            agent._largest("tombstone_bytes")._pop_tombstone()

    def unbury(self, req: str) -> tuple | None:
        """Remove the tombstone of ``req``; its ``(xid, code, reason)``, or None."""
        tomb = self.tombstones.pop(req, None)
        if tomb is None:
            return None
        self._count_tombstone(-1, -tomb[3])
        return tomb[:3]

    def buried_xid(self, req: str) -> int | None:
        """The attempt of ``req`` a tombstone remembers, or None."""
        tomb = self.tombstones.get(req)
        return None if tomb is None else tomb[0]

    def _pop_tombstone(self) -> None:
        _, tomb = self.tombstones.popitem(last=False)
        self._count_tombstone(-1, -tomb[3])

    def _count_tombstone(self, num: int, nbytes: int) -> None:
        self.num_tombstones += num
        self.tombstone_bytes += nbytes
        if self.is_open:
            self.agent.num_tombstones += num
            self.agent.tombstone_bytes += nbytes

    # ---- notifications (D side) ----------------------------------------------------------
    def add_note(self, nbytes: int) -> None:
        lim, agent = self.limits, self.agent
        if nbytes > lim.max_notify_bytes:
            raise LimitExceeded(f"NOTIFY of {nbytes} B exceeds {lim.max_notify_bytes} B")
        if self.notes >= lim.max_notes or self.note_bytes + nbytes > lim.max_note_bytes:
            raise LimitExceeded(f"{self.notes} notifications ({self.note_bytes} B) from this peer are "
                                f"not drained yet (limits {lim.max_notes}, {lim.max_note_bytes} B)")
        if agent.notes >= lim.max_agent_notes or agent.note_bytes + nbytes > lim.max_agent_note_bytes:
            raise LimitExceeded(f"{agent.notes} notifications ({agent.note_bytes} B) from all peers are "
                                f"not drained yet (agent limits {lim.max_agent_notes}, "
                                f"{lim.max_agent_note_bytes} B)")
        self._count_note(1, nbytes)

    def drain_note(self, nbytes: int) -> None:
        self._count_note(-1, -nbytes)

    def _count_note(self, num: int, nbytes: int) -> None:
        # queued notifications stay counted in the agent after the peer left, until drained
        self.notes += num
        self.note_bytes += nbytes
        self.agent.notes += num
        self.agent.note_bytes += nbytes

    # ---- staging requests (D side) -------------------------------------------------------
    def add_stage_req(self) -> None:
        lim = self.limits
        if self.stage_reqs >= lim.max_stage_reqs:
            raise LimitExceeded(f"more than {lim.max_stage_reqs} staging requests outstanding")
        if self.agent.stage_reqs >= lim.max_agent_stage_reqs:
            raise LimitExceeded(f"more than {lim.max_agent_stage_reqs} staging requests outstanding "
                                "from all peers")
        self._count_stage_req(1)

    def end_stage_req(self) -> None:
        self._count_stage_req(-1)

    def _count_stage_req(self, num: int) -> None:
        self.stage_reqs += num
        if self.is_open:
            self.agent.stage_reqs += num

    # ---- disconnect ----------------------------------------------------------------------
    def close(self) -> None:
        """The peer disconnected (lock held): drop its caches and stop counting its
        staging requests in the agent (their grants are freed without a word from it).
        Its undrained notifications stay counted until drained."""
        if not self.is_open:
            return
        self.posts.clear()
        self.tombstones.clear()
        agent = self.agent
        agent.num_posts -= self.num_posts
        agent.posted_blocks -= self.posted_blocks
        agent.num_tombstones -= self.num_tombstones
        agent.tombstone_bytes -= self.tombstone_bytes
        agent.stage_reqs -= self.stage_reqs
        self.num_posts = self.posted_blocks = self.num_tombstones = self.tombstone_bytes = 0
        self.is_open = False
        agent.books.pop(self.serial, None)
