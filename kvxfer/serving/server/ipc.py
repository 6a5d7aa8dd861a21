"""Router <-> worker messaging over a private socket pair.

The launcher creates a ``socket.socketpair()`` per worker and passes one end to
the child by file descriptor (``--ipc-fd``), so the channel needs no port, no
address and no authentication: only the two processes hold it. A message is a
JSON object framed by a 4-byte big-endian length. JSON, not pickle: a worker
never executes what it reads.

Message vocabulary (``op`` router -> worker, ``ev`` worker -> router; every
request-scoped message carries ``rid``):

======================  =====================================================
``op: admit``           decode/colocated: take a request (``prompt_ids``,
                        ``params``, ``mode`` ``"remote"`` or ``"local"``)
``op: prefill``         prefill: compute ``prompt_ids``, sample the first token,
                        send blocks ``[skip_blocks:]`` to agent ``dst``
``op: first_token``     decode: the token the prefill worker sampled
``op: transfer_failed`` decode: the prefill side could not send
``op: abort``           any: drop the request (client gone, stop string hit)
``op: stats``           any: reply ``ev: stats`` with counters (``qid``)
``op: shutdown``        any: finish in-flight requests, then exit
``ev: ready``           worker is up (``agent_address``, ``num_blocks``, ...)
``ev: admitted``        decode: blocks reserved, ``cached_blocks`` reused
``ev: token``           a generated token id
``ev: sent``            prefill: KV delivered (``kv_bytes``, ``transfer_ms``)
``ev: send_failed``     prefill: KV not delivered (``error``)
``ev: kv``              decode: KV landed or was recomputed (``recomputed``)
``ev: done``            request finished (``finish_reason``)
``ev: error``           request failed (``error``, ``kind``)
======================  =====================================================
"""
from __future__ import annotations

import asyncio
import json
import queue
import socket
import struct
import threading

from ...errors import ProtocolError

_HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 64 << 20  # a 1M-token prompt as JSON ints still fits


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"IPC message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict:
    try:
        msg = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"malformed IPC message: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("IPC message is not a JSON object")
    return msg


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


class WorkerChannel:
    """The worker's end: blocking sends, and a reader thread feeding :attr:`inbox`.

    End of stream (the router went away) arrives in the inbox as
    ``{"op": "eof"}``, so a worker loop sees it like any other message.
    """

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._send_lock = threading.Lock()
        self.inbox: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, name="ipc-reader", daemon=True)
        self._reader.start()

    @classmethod
    def from_fd(cls, fd: int) -> "WorkerChannel":
        return cls(socket.socket(fileno=fd))

    def send(self, msg: dict) -> None:
        frame = encode(msg)
        with self._send_lock:
            self._sock.sendall(frame)

    def _read_loop(self) -> None:
        try:
            while True:
                header = _recv_exact(self._sock, _HEADER.size)
                if header is None:
                    break
                body = _recv_exact(self._sock, _HEADER.unpack(header)[0])
                if body is None:
                    break
                self.inbox.put(decode(body))
        except (OSError, ProtocolError):
            pass
        self.inbox.put({"op": "eof"})

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class RouterChannel:
    """The router's end, on the server's event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> "RouterChannel":
        reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_MESSAGE_BYTES)
        return cls(reader, writer)

    def send(self, msg: dict) -> None:
        """Queue ``msg`` for the worker; raises ``ConnectionError`` once it is gone."""
        if self._writer.is_closing():
            raise ConnectionError("worker channel closed")
        self._writer.write(encode(msg))

    async def recv(self) -> dict | None:
        """Next message, or None at end of stream (the worker exited)."""
        try:
            header = await self._reader.readexactly(_HEADER.size)
            body = await self._reader.readexactly(_HEADER.unpack(header)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return decode(body)

    def close(self) -> None:
        self._writer.close()
