"""The store's request/reply messages, after the agents' handshake authenticated a client.

Frames are kvxfer's one frame codec (:mod:`kvxfer.framing`) with a JSON
payload; keys travel as hex. Every request carries an ``id`` that its reply repeats.
A node answers every request except RELEASE (fire-and-forget, applied in order):

====================  ===========================================================  =====================================
request               fields                                                       reply fields
====================  ===========================================================  =====================================
LOOKUP                ``keys``                                                     ``present``: ``"1101..."`` per key
RESERVE               ``keys``, ``nbytes``, ``fmt``                                ``r``: ``[[code, offset, token], ...]``
COMMIT                ``keys``, ``tokens``, ``crcs``                               ``ok``: ``[bool, ...]``
ABORT                 ``keys``, ``tokens``                                         (empty)
GET                   ``keys``, ``fmt``                                            ``r``: ``[[offset, nbytes, crc, pin], ...]`` (pin 0: miss)
RELEASE               ``pins``, ``bad`` (the pins whose bytes failed the checksum)  none
STATS                 (none)                                                       the node's counters
====================  ===========================================================  =====================================

A request that fails validation (unknown type, missing, extra or mistyped field, a key
of 0 or over 64 bytes, too many keys, a frame over :data:`MAX_REQUEST_BYTES`) gets
``{"id": ..., "error": code, "reason": ...}`` and nothing else happens: the connection
and every other request go on. An oversize frame's payload is skipped unread.
"""
from __future__ import annotations

import enum
import json

from ..framing import HEADER, MAGIC, PROTOCOL_VERSION, encode_frame
from ..errors import ProtocolError
from .keys import MAX_KEY_BYTES

__all__ = ["Req", "REPLY", "MAX_KEYS", "MAX_REQUEST_BYTES", "NO_CRC", "RequestReader", "encode", "parse_request"]

MAX_KEYS = 4096  # keys (or pins) one request may name
MAX_REQUEST_BYTES = 1 << 20  # 4096 keys of 64 bytes in hex fit with room to spare
MAX_FMT = 64
NO_CRC = 2**64 - 1  # the checksum of an object put without one (KVStore(checksum=False))


class Req(enum.IntEnum):
    LOOKUP = 64
    RESERVE = 65
    COMMIT = 66
    ABORT = 67
    GET = 68
    RELEASE = 69
    STATS = 70


REPLY = 80

_SCHEMAS = {
    Req.LOOKUP: {"keys": "keys"},
    Req.RESERVE: {"keys": "keys", "nbytes": "size", "fmt": "fmt"},
    Req.COMMIT: {"keys": "keys", "tokens": "ints", "crcs": "crcs"},
    Req.ABORT: {"keys": "keys", "tokens": "ints"},
    Req.GET: {"keys": "keys", "fmt": "fmt"},
    Req.RELEASE: {"pins": "ints", "bad": "ints"},
    Req.STATS: {},
}


def encode(msg_type: int, obj: dict) -> bytes:
    """One frame; keys (``bytes``) in ``obj["keys"]`` are sent as hex."""
    if "keys" in obj:
        obj = {**obj, "keys": [k.hex() for k in obj["keys"]]}
    return encode_frame(int(msg_type), json.dumps(obj, separators=(",", ":")).encode(), MAX_REQUEST_BYTES)


def _check(name: str, kind: str, value):
    def bad(why: str):
        return ProtocolError(f"field {name!r}: {why}")

    if kind in ("ints", "crcs", "keys"):
        if not isinstance(value, list):
            raise bad("must be a list")
        if len(value) > MAX_KEYS:
            raise bad(f"{len(value)} items exceed {MAX_KEYS}")
    if kind == "keys":
        out = []
        for k in value:
            if not isinstance(k, str) or not 0 < len(k) <= 2 * MAX_KEY_BYTES:
                raise bad(f"a key must be 1..{MAX_KEY_BYTES} bytes of hex")
            try:
                out.append(bytes.fromhex(k))
            except ValueError:
                raise bad("a key is not hex") from None
        return out
    if kind in ("ints", "crcs"):
        top = 2**64 if kind == "crcs" else 2**63
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < top:
                raise bad("items must be non-negative ints in range")
        return value
    if kind == "size":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad("must be a positive int")
        return value
    if kind == "fmt":
        if not isinstance(value, str) or len(value) > MAX_FMT:
            raise bad(f"must be a string of at most {MAX_FMT} chars")
        return value
    raise AssertionError(kind)


def parse_request(msg_type: int, payload: bytes) -> tuple[Req, int, dict]:
    """``(type, id, fields)`` of a well-formed request, else :class:`ProtocolError`
    (with ``.request_id`` set when the id could be read)."""
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"request is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("request is not a JSON object")
    rid = obj.pop("id", None)
    if isinstance(rid, bool) or not isinstance(rid, int):
        raise ProtocolError("request needs an integer id")
    try:
        kind = Req(msg_type)
    except ValueError:
        err = ProtocolError(f"unknown request type {msg_type}")
        err.request_id = rid
        raise err from None
    schema = _SCHEMAS[kind]
    try:
        if set(obj) != set(schema):
            raise ProtocolError(f"{kind.name} needs fields {sorted(schema)}, got {sorted(obj)}")
        fields = {name: _check(name, k, obj[name]) for name, k in schema.items()}
        lists = [len(fields[n]) for n in ("keys", "tokens", "crcs") if n in fields]
        if len(set(lists)) > 1:
            raise ProtocolError(f"{kind.name}: keys, tokens and crcs must have one length")
    except ProtocolError as exc:
        exc.request_id = rid
        raise
    return kind, rid, fields


class RequestReader:
    """Whole ``(msg_type, payload)`` frames out of stream chunks; a frame over
    :data:`MAX_REQUEST_BYTES` comes out as ``(msg_type, None)`` after its payload was
    skipped (the caller answers it with an error). A bad magic or version raises
    :class:`ProtocolError`: the stream cannot be trusted past it."""

    def __init__(self, limit: int = MAX_REQUEST_BYTES) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._skip = 0

    def feed(self, data: bytes) -> list:
        out = []
        buf = self._buf
        buf += data
        pos = 0
        while True:
            if self._skip:
                n = min(self._skip, len(buf) - pos)
                self._skip -= n
                pos += n
                if self._skip:
                    break
            if len(buf) - pos < HEADER.size:
                break
            magic, version, msg_type, length = HEADER.unpack_from(buf, pos)
            if magic != MAGIC or version != PROTOCOL_VERSION:
                raise ProtocolError("bad frame magic or version")
            if length > self.limit:
                pos += HEADER.size
                self._skip = length
                out.append((msg_type, None))
                continue
            if len(buf) - pos - HEADER.size < length:
                break
            start = pos + HEADER.size
            out.append((msg_type, bytes(buf[start:start + length])))
            pos = start + length
        del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)
