"""Peers and the control-connection handlers of an agent.

:class:`Peer` is what :meth:`Agent.connect` returns (and what an accepted
connection becomes once its handshake completed). :class:`InboundHandler` runs
the accepting side's handshake state machine in the I/O thread, then hands every
frame to the agent's :class:`~kvxfer.control.connections.Connections`, like
:class:`PeerHandler` does for connections we opened (through its handler
interface only).
"""
from __future__ import annotations

import itertools
import socket

from ..errors import ConnectionRefused, KVXferError, TransferTimeout
from .framing import MAX_PAYLOAD
from .gate import HELLO_DEADLINE_S, PREAUTH_MAX_FRAME
from .limits import AgentBook
from .messages import Msg, encode


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
        self.conn = None  # control connection
        self.bconn = None  # backend connection
        self.is_connected = True
        # what this peer makes us hold, bounded per peer and in the agent's total (limits.py)
        self.book = (books if books is not None else AgentBook()).open(self.serial)

    @property
    def transport(self) -> str:
        """What actually carries the bytes (e.g. ``vm``, ``ucx:cma``, ``loopback``)."""
        return self.bconn.transport if self.bconn is not None else "none"

    def send(self, frame: bytes, more: bool = False) -> bool:
        return self.is_connected and self.conn.send(frame, more)

    def __repr__(self) -> str:
        state = "connected" if self.is_connected else "disconnected"
        return f"<Peer {self.name!r} {state} transport={self.transport}>"


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


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
    agent's pre-auth slots (:mod:`kvxfer.control.gate`) from its accept until it
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
        return self.hs.state != Msg.HELLO

    def on_open(self, conn) -> None:
        self.conn = conn
        conn.reader.max_payload = PREAUTH_MAX_FRAME

        def expire(what: str, still) -> None:
            if conn.peer is None and not conn.closed and still():
                conn.loop.close_conn(conn, TransferTimeout(f"{what} timed out"))

        conn.loop.call_later(HELLO_DEADLINE_S, lambda: expire("waiting for HELLO", lambda: self.hs.state == Msg.HELLO))
        conn.loop.call_later(self.conns.handshake_timeout, lambda: expire("handshake", lambda: True))

    def evict(self, why: str) -> None:
        """The gate gave this connection's slot to a newer one (I/O thread): REJECT
        ``busy`` and close; frames that still arrive are ignored."""
        self.evicted = True
        conn = self.conn
        if conn is None or conn.closed:
            return
        conn.send(encode(Msg.REJECT, code="busy", reason=why[:200]))
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
        if self.hs.state in (Msg.INFO, Msg.REJECT):  # authenticated: no longer pre-auth, its INFO may be large
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
