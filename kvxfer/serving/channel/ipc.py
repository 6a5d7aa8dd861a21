"""Router <-> worker messaging over a private socket pair.

The launcher creates a ``socket.socketpair()`` per worker and passes one end to
the child by file descriptor (``--ipc-fd``), so the channel needs no port, no
address and no authentication: only the two processes hold it. A message is a
JSON object in one frame of kvxfer's frame codec (:mod:`kvxfer.framing`,
type :data:`IPC_MSG`). JSON, not pickle: a worker never executes what it reads.

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
``op: switch_role``     prefill/decode: finish what it holds, free every KV
                        block, then serve as ``role`` (adaptive rebalancing)
``op: kv_snapshot``     any: send every hash of the prefix cache (``ev: kv_events``)
``ev: ready``           worker is up (``agent_address``, ``num_blocks``, ...)
``ev: admitted``        decode: blocks reserved, ``cached_blocks`` reused
``ev: token``           a generated token id (``token``), and its ``logprobs``
                        when the request asked for them
``ev: sent``            prefill: KV delivered (``kv_bytes``, ``transfer_ms``)
``ev: send_failed``     prefill: KV not delivered (``error``)
``ev: kv``              decode: KV landed or was recomputed (``recomputed``)
``ev: done``            request finished (``finish_reason``)
``ev: error``           request failed (``error``, ``kind``)
``ev: role_changed``    answer to ``switch_role`` (``ok``, ``role``, ``error``)
``ev: kv_events``       the prefix cache changed: block hashes ``stored``
                        (cached now) and ``removed`` (gone), at most
                        ``MAX_EVENT_HASHES`` in all (after each step)
======================  =====================================================
"""
from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading

from ...framing import json_frame, json_payload, read_frame, read_frame_async
from ...errors import ProtocolError

log = logging.getLogger("kvxfer.worker")

# kvxfer serve hands its spawned workers the agents' secret in this variable (hex), never on
# a command line; the worker takes it out of its environment once read
AGENT_SECRET_ENV = "KVXFER_AGENT_SECRET"
IPC_MSG = 0x40  # frame type of a router <-> worker message (agent control types are < 0x40)
MAX_MESSAGE_BYTES = 64 << 20  # a 1M-token prompt as JSON ints still fits
MAX_EVENT_HASHES = 4096  # hashes (stored + removed) in one kv_events message


def pool_salt(model: str, matmul_dtype: str, kv_fingerprint: str) -> bytes:
    """The KV pool keys' salt (:func:`kvxfer.store.block_keys`) of the model a worker's
    ``ready`` message names (``model``, ``matmul``, ``kv_fingerprint``): its name, its
    projection dtype (it changes the KV's values) and its KV layout's fingerprint. The
    prefill workers key the pool with it, and the router looks prompts up with it."""
    return f"kvxfer-serve|{model}|{matmul_dtype}|{kv_fingerprint}".encode()


def kv_event_batches(stored: list[int], removed: list[int]):
    """``(stored, removed)`` split into the lists of successive ``kv_events`` messages, at
    most :data:`MAX_EVENT_HASHES` hashes each (a hash is in one list only, so the split
    order is free); nothing for two empty lists."""
    while stored or removed:
        n = min(len(removed), MAX_EVENT_HASHES)
        yield stored[:MAX_EVENT_HASHES - n], removed[:n]
        stored, removed = stored[MAX_EVENT_HASHES - n:], removed[n:]


def encode(msg: dict) -> bytes:
    return json_frame(IPC_MSG, msg, MAX_MESSAGE_BYTES)


def decode(msg_type: int, payload: bytes) -> dict:
    if msg_type != IPC_MSG:
        raise ProtocolError(f"not a router/worker message (frame type {msg_type})")
    return json_payload(payload)


def recv_message(sock: socket.socket, limit: int = MAX_MESSAGE_BYTES) -> dict | None:
    """Blocking read of one message; None when the stream ends between messages."""
    frame = read_frame(sock, limit)
    return None if frame is None else decode(*frame)


async def recv_message_async(reader: asyncio.StreamReader, limit: int = MAX_MESSAGE_BYTES) -> dict:
    """One message from ``reader``; ``asyncio.IncompleteReadError`` at the end of the stream."""
    return decode(*await read_frame_async(reader, limit))


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
            while (msg := recv_message(self._sock)) is not None:
                self.inbox.put(msg)
        except OSError:
            pass
        except ProtocolError as exc:  # the router sent garbage: treat it as gone
            log.error("bad message from the router, closing the channel: %s", exc)
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
            return await recv_message_async(self._reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def close(self) -> None:
        self._writer.close()
