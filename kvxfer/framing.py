"""Length-prefixed frames on a stream: the one frame codec of kvxfer.

A frame is an 8-byte header ``!2sBBI`` -- magic ``b"KX"``, protocol version,
message type, payload length -- followed by ``length`` payload bytes. The
payload is a UTF-8 JSON object (or, for the agents' per-request messages, the
binary layout of :mod:`kvxfer.agent.protocol`): the agents' control messages
(validated by :mod:`kvxfer.agent.protocol`) and the serving stack's router <-> worker
messages (:mod:`kvxfer.serving.channel.ipc`, :func:`json_frame`/:func:`json_payload`).
Every reader takes the largest payload it accepts for that stream and state
(e.g. 4 KiB before a peer has authenticated).

:class:`FrameReader` is fed whatever the socket returned and yields whole
frames; a bad magic, version, or a length over :data:`MAX_PAYLOAD` raises
:class:`~kvxfer.errors.ProtocolError` before any payload is buffered, so a
peer cannot make us allocate more than one maximum frame.
"""
from __future__ import annotations

import json
import struct

from .errors import ProtocolError

__all__ = ["HEADER", "MAGIC", "MAX_PAYLOAD", "PROTOCOL_VERSION", "FrameReader", "encode_frame", "json_frame",
           "json_payload", "parse_header", "read_frame", "read_frame_async", "recv_frame"]

MAGIC = b"KX"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!2sBBI")
MAX_PAYLOAD = 4 << 20  # 4 MiB: block-id lists of thousands of blocks fit easily


def encode_frame(msg_type: int, payload: bytes, limit: int = MAX_PAYLOAD) -> bytes:
    if len(payload) > limit:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {limit}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, len(payload)) + payload


def json_frame(msg_type: int, obj: dict, limit: int = MAX_PAYLOAD) -> bytes:
    """``obj`` as compact JSON in one frame (ValueError over ``limit`` bytes)."""
    return encode_frame(msg_type, json.dumps(obj, separators=(",", ":")).encode(), limit)


def json_payload(payload: bytes) -> dict:
    """The JSON object in a frame's payload, or :class:`ProtocolError`."""
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"frame payload is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame payload is not a JSON object")
    return obj


def parse_header(header: bytes, limit: int = MAX_PAYLOAD) -> tuple[int, int]:
    """Return ``(msg_type, length)`` or raise :class:`ProtocolError` (also for a length over ``limit``)."""
    if len(header) != HEADER.size:
        raise ProtocolError("truncated frame header")
    magic, version, msg_type, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (speaking {PROTOCOL_VERSION})")
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return msg_type, length


class FrameReader:
    """Reassembles frames from arbitrary stream chunks."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self.max_payload = max_payload  # a connection still authenticating gets a small one
        self._buf = bytearray()
        self._need: tuple[int, int] | None = None  # header parsed, waiting for payload

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Append ``data``; return every complete ``(msg_type, payload)``."""
        frames = []
        if not self._buf and self._need is None:
            # common case: whole frames straight out of ``data``, no buffer copies
            pos, end = 0, len(data)
            while end - pos >= HEADER.size:
                msg_type, length = parse_header(data[pos:pos + HEADER.size], self.max_payload)
                if end - pos - HEADER.size < length:
                    break
                pos += HEADER.size
                frames.append((msg_type, data[pos:pos + length]))
                pos += length
            if pos == end:
                return frames
            data = data[pos:]
        self._buf += data
        while True:
            if self._need is None:
                if len(self._buf) < HEADER.size:
                    break
                self._need = parse_header(bytes(self._buf[: HEADER.size]), self.max_payload)
                del self._buf[: HEADER.size]
            msg_type, length = self._need
            if len(self._buf) < length:
                break
            frames.append((msg_type, bytes(self._buf[:length])))
            del self._buf[:length]
            self._need = None
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)


def recv_frame(sock, timeout: float) -> tuple[int, bytes]:
    """Blocking read of exactly one frame (used by the connecting side's handshake)."""
    sock.settimeout(timeout)
    frame = read_frame(sock)
    if frame is None:
        raise ConnectionError("connection closed")
    return frame


def read_frame(sock, limit: int = MAX_PAYLOAD) -> tuple[int, bytes] | None:
    """Blocking read of one ``(msg_type, payload)``; None if the stream ends before a
    header. Raises :class:`ProtocolError` (bad header, over ``limit``) or
    ``ConnectionError`` (the stream ends inside a frame)."""
    header = _recv_exact(sock, HEADER.size, at_start=True)
    if header is None:
        return None
    msg_type, length = parse_header(header, limit)
    return msg_type, _recv_exact(sock, length)


async def read_frame_async(reader, limit: int = MAX_PAYLOAD) -> tuple[int, bytes]:
    """:func:`read_frame` on an ``asyncio.StreamReader``; raises
    ``asyncio.IncompleteReadError`` at the end of the stream."""
    msg_type, length = parse_header(await reader.readexactly(HEADER.size), limit)
    return msg_type, await reader.readexactly(length)


def _recv_exact(sock, n: int, at_start: bool = False) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            if at_start and not chunks:
                return None
            raise ConnectionError("connection closed")
        chunks += chunk
    return bytes(chunks)
