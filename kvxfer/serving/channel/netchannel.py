"""Router <-> worker messaging over TCP, for workers on other hosts (``kvxfer worker``).

The same length-prefixed JSON frames and vocabulary as :mod:`kvxfer.serving.channel.ipc`,
behind the agents' mutual HMAC-SHA256 challenge over the deployment's shared secret
(:class:`kvxfer.auth.HmacChallenge`, here with the domain ``kvxfer-router``: the secret
never crosses the wire, and a proof made for the agents' handshake is refused here and
the other way round)::

    worker -> router  {"hello": "kvxfer-worker/1", "nonce": Ns}
    router -> worker  {"nonce": Nr, "mac": CHALLENGE.client_mac(secret, Ns, Nr)}
    worker -> router  {"mac": CHALLENGE.server_mac(secret, Nr, Ns)}, then its ``ready``
                      (or {"auth": "refused"} and close)

It has the agents' pre-auth bounds (:mod:`kvxfer.config`): before that exchange a
frame may hold at most ``PREAUTH_MAX_FRAME`` bytes, and the whole exchange must finish
within ``HANDSHAKE_TIMEOUT_S`` of the accept (the worker closes a connection that has
not, and one whose router has not answered the hello within ``HELLO_DEADLINE_S``; the
router gives up after its ``timeout``). Unauthenticated connections are
admitted by the agents' gate (:class:`kvxfer.auth.HandshakeGate`: bounded pending slots,
per source too; a new connection evicts the oldest pending one of the source holding
the most, so connections that stall in the handshake never lock a router out). The
traffic itself is not encrypted (as the agents' control traffic): run it on a private
network.

:class:`NetWorkerChannel` (worker side) keeps listening: one router at a time,
the newest authenticated one wins. When a router goes away, every request it
had handed over and that has not finished is aborted (``op: abort`` into the
inbox), so the worker frees its blocks and serves the next router; the worker
itself keeps running (a restarted router finds it again).
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import select
import socket
import threading
import time

from ...auth import HmacChallenge
from ...config import HANDSHAKE_TIMEOUT_S, HELLO_DEADLINE_S, PREAUTH_MAX_FRAME
from ...secrets import normalize_secret
from ...errors import AuthenticationError, ProtocolError
from .ipc import RouterChannel, encode, recv_message, recv_message_async

log = logging.getLogger("kvxfer.worker")

CHALLENGE = HmacChallenge(b"kvxfer-router")  # the router proves first (C), the worker second (S)
HELLO = "kvxfer-worker/1"
_FINISHING = {"done", "error", "sent", "send_failed"}  # a request's last event on this worker
_SWEEP_S = 0.5  # how often the acceptor closes handshakes past their deadline


class _Pending:
    """A connection still in the handshake: an entry of the :class:`~kvxfer.auth.HandshakeGate`."""

    def __init__(self, sock: socket.socket, source: str):
        self.sock, self.source = sock, source
        self.said_hello = False  # the router answered the worker's hello
        now = time.monotonic()
        self.deadline = now + HANDSHAKE_TIMEOUT_S
        self.hello_by = now + HELLO_DEADLINE_S  # its answer to the hello, as the agents' HELLO deadline


class _Conn:
    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.rids: set[str] = set()
        self.lock = threading.Lock()


class NetWorkerChannel:
    """Worker end: listens on ``listen`` (``host:port``); same ``inbox``/``send`` as
    :class:`kvxfer.serving.channel.ipc.WorkerChannel`. ``set_hello(msg)`` stores the ``ready``
    message every newly connected router receives first."""

    def __init__(self, listen: str, secret: bytes):
        from ...auth import HandshakeGate
        from ...net import split_address

        self._secret = normalize_secret(secret)
        host, port = split_address(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._lsock.bind((host, port))
            self._lsock.listen(16)
        except OSError:
            self._lsock.close()
            raise
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self.inbox: queue.Queue[dict] = queue.Queue()
        self._hello: dict | None = None
        self._current: _Conn | None = None
        self._lock = threading.Lock()
        self._gate = HandshakeGate()  # guarded by self._lock
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name="net-accept", daemon=True)
        self._acceptor.start()

    def set_hello(self, msg: dict) -> None:
        self._hello = dict(msg)
        with self._lock:
            conn = self._current
        if conn is not None:
            self._send_on(conn, msg)

    def send(self, msg: dict) -> None:
        """To the current router; dropped when none is connected (its requests were aborted)."""
        if msg.get("ev") == "ready":
            return self.set_hello(msg)
        with self._lock:
            conn = self._current
        if msg.get("ev") in _FINISHING and msg.get("rid") is not None:
            if conn is not None:
                conn.rids.discard(msg["rid"])
        if conn is not None:
            self._send_on(conn, msg)

    def _send_on(self, conn: _Conn, msg: dict) -> None:
        frame = encode(msg)
        try:
            with conn.lock:
                conn.sock.sendall(frame)
        except OSError:
            pass  # the reader sees the end of the connection and cleans up

    # ---- accepting routers ----------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            self._close_late_handshakes()
            try:
                ready, _, _ = select.select([self._lsock], [], [], _SWEEP_S)
                if not ready:
                    continue
                sock, addr = self._lsock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            entry = _Pending(sock, addr[0])
            with self._lock:
                evicted = self._gate.admit(entry)
            for old in evicted:  # its handshake thread sees the end of stream and closes it
                _shutdown(old.sock)
            threading.Thread(target=self._handshake, args=(entry, f"{addr[0]}:{addr[1]}"),
                             name="net-handshake", daemon=True).start()

    def _close_late_handshakes(self) -> None:
        """Shut every pending connection past its deadline down; its handshake thread then
        sees the end of the stream and gives the slot back. (A socket timeout alone
        would bound each read, not the handshake: a router dripping one byte a second
        would hold its slot for hours.)"""
        now = time.monotonic()
        with self._lock:  # under the lock: a connection that authenticated meanwhile is no entry any more
            for entry in self._gate.entries():
                if entry.deadline <= now or (not entry.said_hello and entry.hello_by <= now):
                    _shutdown(entry.sock)

    def _handshake(self, entry: _Pending, peer: str) -> None:
        sock = entry.sock
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)  # no single read outlives the deadline's sweep by much
            nonce_s = CHALLENGE.new_nonce()
            sock.sendall(encode({"hello": HELLO, "nonce": nonce_s.hex()}))
            reply = recv_message(sock, PREAUTH_MAX_FRAME)
            if reply is None or time.monotonic() > entry.deadline:
                raise ProtocolError("router closed during the handshake, or did not finish it in time")
            entry.said_hello = True
            nonce_r = bytes.fromhex(str(reply.get("nonce", "")))
            got = bytes.fromhex(str(reply.get("mac", "")))
            try:
                proved = CHALLENGE.verify(CHALLENGE.client_mac(self._secret, nonce_s, nonce_r), got)
            except ValueError:  # a nonce of the wrong length proves nothing
                proved = False
            if not proved:
                sock.sendall(encode({"auth": "refused"}))
                raise AuthenticationError("router failed to prove the shared secret")
            sock.sendall(encode({"mac": CHALLENGE.server_mac(self._secret, nonce_r, nonce_s).hex()}))
            sock.settimeout(None)
        except (OSError, ValueError, ProtocolError, AuthenticationError) as exc:
            log.warning("refused a router connection from %s: %s", peer, exc)
            sock.close()
            return
        finally:
            with self._lock:
                self._gate.release(entry)
        conn = _Conn(sock, peer)
        with self._lock:
            old, self._current = self._current, conn
        if old is not None:  # newest router wins; the old one's requests are aborted
            _shutdown(old.sock)
        if self._hello is not None:
            self._send_on(conn, self._hello)
        log.info("router connected from %s", peer)
        self._read(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            while True:
                msg = recv_message(conn.sock)
                if msg is None:
                    break
                if msg.get("op") in ("admit", "prefill") and msg.get("rid") is not None:
                    conn.rids.add(msg["rid"])
                self.inbox.put(msg)
        except OSError:
            pass
        except ProtocolError as exc:
            log.warning("bad message from router %s, dropping it: %s", conn.peer, exc)
        with self._lock:
            if self._current is conn:
                self._current = None
        conn.sock.close()
        lost = sorted(conn.rids)
        conn.rids.clear()
        for rid in lost:
            self.inbox.put({"op": "abort", "rid": rid})
        if not self._closed.is_set():
            log.warning("router %s went away; aborted its %d requests", conn.peer, len(lost))

    def close(self) -> None:
        self._closed.set()
        self._lsock.close()
        with self._lock:
            conn, self._current = self._current, None
        if conn is not None:
            _shutdown(conn.sock)
        self._acceptor.join(2)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


async def connect_worker(address: str, secret: bytes,
                         timeout: float = HANDSHAKE_TIMEOUT_S) -> tuple[RouterChannel, dict]:
    """Router end: connect, prove the secret, check the worker's proof, all within
    ``timeout`` seconds; returns the channel and the worker's ``ready`` message. Raises
    ``OSError``/``asyncio.TimeoutError``, :class:`AuthenticationError` or :class:`ProtocolError`."""
    from ...net import split_address

    secret = normalize_secret(secret)
    host, port = split_address(address)

    async def handshake():
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 30)
        try:
            hello = await recv_message_async(reader, PREAUTH_MAX_FRAME)
            if hello.get("hello") != HELLO:
                raise ProtocolError(f"not a kvxfer worker at {address}: {json.dumps(hello)[:80]}")
            nonce_s = bytes.fromhex(str(hello.get("nonce", "")))
            nonce_r = CHALLENGE.new_nonce()
            writer.write(encode({"nonce": nonce_r.hex(),
                                 "mac": CHALLENGE.client_mac(secret, nonce_s, nonce_r).hex()}))
            proof = await recv_message_async(reader, PREAUTH_MAX_FRAME)
            if proof.get("auth") == "refused":
                raise AuthenticationError(f"worker at {address} refused our proof of the shared secret")
            got = bytes.fromhex(str(proof.get("mac", "")))
            if not CHALLENGE.verify(CHALLENGE.server_mac(secret, nonce_r, nonce_s), got):
                raise AuthenticationError(f"worker at {address} failed to prove the shared secret")
            ready = await recv_message_async(reader, 1 << 20)
            return RouterChannel(reader, writer), ready
        except BaseException:
            writer.close()
            raise

    try:
        return await asyncio.wait_for(handshake(), timeout)
    except asyncio.IncompleteReadError:
        raise ProtocolError(f"worker at {address} closed during the handshake") from None
    except ValueError as exc:  # bad hex, or a nonce of the wrong length
        raise ProtocolError(f"malformed handshake from {address}: {exc}") from None
