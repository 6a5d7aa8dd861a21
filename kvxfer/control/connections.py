"""An agent's control connections: listening, connecting, handshakes, routing.

:class:`Connections` owns the listening socket's admission (the pre-auth gate),
the client and server handshakes, the set of connected peers (``state.peers``)
and the dispatch table that hands each frame after the handshake to the part
that owns it (sender, receiver, notifications). The connection handlers of
:mod:`.peers` talk to it only through the methods marked *handler interface*.
"""
from __future__ import annotations

import socket

from ..errors import KVXferError, PeerDisconnected, ProtocolError, TransferTimeout
from .gate import HandshakeGate
from .handshake import ServerHandshake, client_handshake
from .limits import AgentBook
from .messages import Msg
from .peers import InboundHandler, Peer, PeerHandler, split_address
from .registration import local_info, parse_info
from .state import AgentState


def listen(address: str) -> tuple[socket.socket, str]:
    """A non-blocking listening socket on ``address`` ("host:port", port 0: any) and its
    actual "host:port"."""
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lsock = socket.socket(family, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        lsock.bind((host, port))
        lsock.listen(128)
    except OSError:
        lsock.close()
        raise
    lsock.setblocking(False)
    return lsock, f"{host}:{lsock.getsockname()[1]}"


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
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except socket.timeout:
            raise TransferTimeout(f"connecting to {address} timed out") from None
        except OSError as exc:
            raise PeerDisconnected(f"cannot reach {address}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fields = client_handshake(sock, self._secret, local_info(self._s), self.parse_info, timeout)
            peer = self.make_peer(fields, address)
        except socket.timeout:
            sock.close()
            raise TransferTimeout(f"handshake with {address} timed out") from None
        except KVXferError:
            sock.close()
            raise
        except (ConnectionError, OSError) as exc:
            sock.close()
            raise PeerDisconnected(f"{address} closed the connection during the handshake: {exc}") from None
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
            self._on_ready(peer)

    def on_frame(self, peer: Peer, kind: Msg, fields: dict) -> None:
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
