"""The agents' message vocabulary: types, strict schemas, payloads, FAIL codes.

Every message carries exactly the schema's fields, each of the declared kind:
a JSON object, except the three on every request's path (RECV_POST, MATCHED,
DATA_DONE), which use the binary layout described below. :func:`decode` is the
only way bytes from a peer become a message; anything else -- unknown type,
invalid UTF-8/JSON/binary, a missing, extra or mistyped field, a negative id --
raises :class:`~kvxfer.errors.ProtocolError`; for the binary ones a
:class:`MalformedPayload` that says which message it was (``kind``) and
holds the fields before the bad one. Frames are :mod:`kvxfer.framing`'s; the
JSON field kinds and their checks are :mod:`kvxfer.fields`'; the handshake's
messages (types 1-7) are :mod:`kvxfer.auth`'s, decoded here too since they share
the connection.

Binary payloads (RECV_POST, MATCHED, DATA_DONE). Their fields are strings,
integers, integer lists, a bool and a head range, so a fixed little-endian
layout, in schema order, replaces JSON (which cost most of the per-message time
of a 1-block request):

- ``int``: u64 (below 2**63); ``bool``: u8, 0 or 1; ``range``: two u32 ``a <= b < 2**31``;
- ``str``: u16 byte length, then UTF-8 (at most ``MAX_STR`` characters);
- ``ints``: u8 item width (2, 4 or 8), u32 count (at most ``MAX_LIST``), the items
  (each below 2**62).

:func:`decode_body` checks all of that and that nothing follows the last field;
any violation -- truncated, trailing or invalid bytes, a value out of range --
raises :class:`MalformedPayload` (a :class:`~kvxfer.errors.ProtocolError`) that
carries the fields decoded before it, so an authenticated peer's bad message can
fail the one request it names instead of the connection. What the values mean is
checked where they are used (the sender checks a RECV_POST, the receiver a DATA_DONE).

A failed check fails that one request on both sides: the other side learns why
from a FAIL message whose ``code`` names the error class (:data:`CODES`).
"""
from __future__ import annotations

import array
import enum
import json
import struct
import sys

from ..auth import SCHEMAS as HANDSHAKE_SCHEMAS, Hs
from ..errors import InvalidDescriptor, KVXferError, LayoutMismatch, LimitExceeded, ProtocolError
from ..fields import ENCODER as _ENCODER, MAX_LIST, MAX_STR, PASS as _PASS
from ..fields import check as _check, ints_ok as _ints_ok, wire as _wire
from ..framing import encode_frame


# ---- binary payloads ------------------------------------------------------------

_U8, _U16, _U32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q"))
_RANGE = struct.Struct("<II")
_CODES = {2: "H", 4: "I", 8: "Q"}
assert all(array.array(c).itemsize == w for w, c in _CODES.items())
_SWAP = sys.byteorder == "big"
_TRUE, _FALSE = b"\1", b"\0"


def _ints_wire(values) -> bytes:
    top = max(values) if len(values) else 0
    width = 2 if top < 1 << 16 else 4 if top < 1 << 32 else 8
    arr = array.array(_CODES[width], values)  # OverflowError: negative or over 64 bits
    if _SWAP:
        arr.byteswap()
    return _U8.pack(width) + _U32.pack(len(arr)) + arr.tobytes()


_WIRE_INTS_CACHE: dict = {}


def _ints_cached(values) -> bytes:
    if type(values) is not tuple or len(values) > 256:
        return _ints_wire(values)
    raw = _WIRE_INTS_CACHE.get(values)  # layer tuples repeat on every request: encode each once
    if raw is None:
        raw = _ints_wire(values)
        if len(_WIRE_INTS_CACHE) >= 1024:
            _WIRE_INTS_CACHE.clear()
        _WIRE_INTS_CACHE[values] = raw
    return raw


def _str_wire(v) -> bytes:
    if type(v) is not str:
        raise TypeError(f"a str, got {type(v).__name__}")
    raw = v.encode("utf-8")
    return _U16.pack(len(raw)) + raw


def _bool_wire(v) -> bytes:
    if type(v) is not bool:
        raise TypeError(f"a bool, got {type(v).__name__}")
    return _TRUE if v else _FALSE


_ENCODERS = {"int": _U64.pack, "str": _str_wire, "ints": _ints_cached, "bool": _bool_wire,
             "range": lambda v: _RANGE.pack(*v)}
_ERRORS = (struct.error, OverflowError, TypeError, ValueError, UnicodeError, KeyError)


def encode_body(name: str, items: tuple, fields: dict) -> bytes:
    """The payload of message ``name`` (schema ``items``: ``((field, kind), ...)``);
    ValueError if a value cannot be represented."""
    try:
        return b"".join([_ENCODERS[kind](fields[k]) for k, kind in items])
    except _ERRORS:
        pass
    for k, kind in items:  # say which field
        try:
            _ENCODERS[kind](fields[k])
        except _ERRORS as exc:
            raise ValueError(f"{name}: field {k!r} ({kind}) cannot be encoded: {exc!r}") from None
    raise ValueError(f"{name}: fields cannot be encoded")


class MalformedPayload(ProtocolError):
    """A payload that does not decode; ``fields``: those before the first bad one (each
    valid), so the receiver can tell which request the message was about."""

    def __init__(self, message: str, fields: dict) -> None:
        super().__init__(message)
        self.fields = fields


def decode_body(name: str, items: tuple, payload: bytes) -> dict:
    """The fields of message ``name`` from ``payload``, or :class:`MalformedPayload`."""
    out = {}
    pos, end = 0, len(payload)
    try:
        for k, kind in items:
            if kind == "int":
                (v,) = _U64.unpack_from(payload, pos)
                pos += 8
                if v >= 1 << 63:
                    raise ProtocolError(f"{name}: {k} out of range")
            elif kind == "str":
                (n,) = _U16.unpack_from(payload, pos)
                pos += 2
                if pos + n > end:
                    raise ProtocolError(f"{name}: truncated {k}")
                v = payload[pos:pos + n].decode("utf-8")
                pos += n
                if len(v) > MAX_STR:
                    raise ProtocolError(f"{name}: {k} longer than {MAX_STR} characters")
            elif kind == "ints":
                width, n = payload[pos], _U32.unpack_from(payload, pos + 1)[0]
                pos += 5
                code = _CODES.get(width)
                if code is None or n > MAX_LIST or pos + n * width > end:
                    raise ProtocolError(f"{name}: invalid list {k}")
                arr = array.array(code, payload[pos:pos + n * width])
                pos += n * width
                if _SWAP:
                    arr.byteswap()
                v = arr.tolist()
                if width == 8 and v and max(v) >= 1 << 62:
                    raise ProtocolError(f"{name}: {k} holds a value out of range")
            elif kind == "bool":
                b = payload[pos]
                pos += 1
                if b > 1:
                    raise ProtocolError(f"{name}: {k} is not a bool")
                v = b == 1
            else:  # range
                a, b = _RANGE.unpack_from(payload, pos)
                pos += 8
                if not a <= b < 1 << 31:
                    raise ProtocolError(f"{name}: {k} is not a range")
                v = (a, b)
            out[k] = v
    except ProtocolError as exc:
        raise MalformedPayload(str(exc), out) from None
    except (struct.error, IndexError, UnicodeDecodeError):
        raise MalformedPayload(f"{name}: truncated or invalid payload", out) from None
    if pos != end:
        raise MalformedPayload(f"{name}: {end - pos} bytes after the last field", out)
    return out


# ---- messages -------------------------------------------------------------------
class Msg(enum.IntEnum):
    # the handshake (kvxfer.auth.Hs: the same numbers and names)
    HELLO = Hs.HELLO
    CHALLENGE = Hs.CHALLENGE
    AUTH = Hs.AUTH
    AUTH_OK = Hs.AUTH_OK
    AUTH_FAIL = Hs.AUTH_FAIL
    INFO = Hs.INFO
    REJECT = Hs.REJECT
    # transfers
    RECV_POST = 10   # D->P: where request `req` goes (blocks, layers, global head range)
    MATCHED = 11     # P->D: P will write `req` (D now fails it if P dies)
    STAGE_REQ = 12   # P->D: reserve `nbytes` of D's staging ring for chunk `tag`
    STAGE_GRANT = 13 # D->P: chunk `tag` may write at `offset` of region `region`
    DATA_DONE = 14   # P->D: chunk written and flushed (pack: unpack it now)
    ACK = 15         # D->P: pack chunk `tag` unpacked, staging freed
    CANCEL = 16      # either way: stop request `req`
    CANCEL_ACK = 17  # P->D: nothing more will be written for `req`
    NOTIFY = 18      # P->D: engine payload, sent after the data it refers to is visible
    STAGE_RELEASE = 19  # P->D: chunk `tag` gave up; free its grant
    FAIL = 20        # either way: request `req` failed; like CANCEL, with the error's `code`


SCHEMAS: dict[Msg, dict[str, str]] = {
    **{Msg(int(k)): schema for k, schema in HANDSHAKE_SCHEMAS.items()},
    Msg.RECV_POST: {"req": "str", "xid": "int", "blocks": "ints", "layers": "ints",
                    "heads": "range", "skip": "int"},
    Msg.MATCHED: {"req": "str", "xid": "int"},
    Msg.STAGE_REQ: {"tag": "int", "nbytes": "int"},
    Msg.STAGE_GRANT: {"tag": "int", "region": "int", "offset": "int"},
    Msg.DATA_DONE: {"req": "str", "xid": "int", "tag": "int", "pack": "bool",
                    "blocks": "ints", "layers": "ints", "heads": "range",
                    "offset": "int", "nbytes": "int"},
    Msg.ACK: {"tag": "int"},
    Msg.CANCEL: {"req": "str", "xid": "int", "to_sender": "bool"},
    Msg.CANCEL_ACK: {"req": "str", "xid": "int"},
    Msg.NOTIFY: {"data": "b64"},
    Msg.STAGE_RELEASE: {"tag": "int"},
    Msg.FAIL: {"req": "str", "xid": "int", "to_sender": "bool", "code": "str", "reason": "str"},
}


_SCHEMA_ITEMS = {t: tuple(s.items()) for t, s in SCHEMAS.items()}
BINARY = frozenset((Msg.RECV_POST, Msg.MATCHED, Msg.DATA_DONE))  # payloads in the layout of .wire


def _fast_ints(value) -> str | None:
    if type(value) is tuple:  # layer lists repeat on every request: format each once
        text = _INTS_CACHE.get(value)
        if text is None and (not value or set(map(type, value)) == {int}):
            text = "[" + ",".join(map(str, value)) + "]"
            if len(_INTS_CACHE) >= 1024:
                _INTS_CACHE.clear()
            _INTS_CACHE[value] = text
        return text
    if type(value) is list and (not value or set(map(type, value)) == {int}):
        return "[" + ",".join(map(str, value)) + "]"
    return None


_INTS_CACHE: dict = {}
_MSGS = {int(m): m for m in Msg}
# JSON text of a field straight from plain Python values; None: let the general path convert it
_FAST = {
    "int": lambda v: str(v) if type(v) is int else None,
    "str": lambda v: _ENCODER.encode(v) if type(v) is str else None,
    "bool": lambda v: ("true" if v else "false") if type(v) is bool else None,
    "ints": _fast_ints,
    "range": lambda v: (f"[{v[0]},{v[1]}]" if type(v) in (tuple, list) and len(v) == 2
                        and type(v[0]) is int and type(v[1]) is int else None),
}
_KEYS = {k: _ENCODER.encode(k) + ":" for schema in SCHEMAS.values() for k in schema}


def encode(msg_type: Msg, **fields) -> bytes:
    """One framed message; ``fields`` must match the schema exactly (else ValueError)."""
    schema = SCHEMAS[msg_type]
    if fields.keys() != schema.keys():
        raise ValueError(f"{msg_type.name} takes fields {sorted(schema)}, got {sorted(fields)}")
    if msg_type in BINARY:
        return encode_frame(int(msg_type), encode_body(msg_type.name, _SCHEMA_ITEMS[msg_type], fields))
    parts = []
    for k, kind in _SCHEMA_ITEMS[msg_type]:
        fast = _FAST.get(kind)
        text = fast(fields[k]) if fast is not None else None
        if text is None:
            break
        parts.append(_KEYS[k] + text)
    else:
        return encode_frame(int(msg_type), ("{" + ",".join(parts) + "}").encode())
    body = {k: v if kind in _PASS else _wire(kind, v) for k, v in fields.items() for kind in (schema[k],)}
    return encode_frame(int(msg_type), _ENCODER.encode(body).encode())


def decode(msg_type: int, payload: bytes) -> tuple[Msg, dict]:
    """Validate one received frame; return ``(type, fields)`` with decoded values."""
    kind = _MSGS.get(msg_type)
    if kind is None:
        raise ProtocolError(f"unknown message type {msg_type}")
    if kind in BINARY:
        try:
            return kind, decode_body(kind.name, _SCHEMA_ITEMS[kind], payload)
        except MalformedPayload as exc:
            exc.kind = kind  # which message it was (the connection may fail just its request)
            raise
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError(f"{kind.name}: payload is not JSON") from None
    schema = SCHEMAS[kind]
    if type(body) is not dict or body.keys() != schema.keys():
        raise ProtocolError(f"{kind.name}: fields do not match the schema")
    out = {}
    for k, t in _SCHEMA_ITEMS[kind]:
        v = body[k]
        # the hot kinds inline; everything else (and every invalid value) through _check
        if t == "int" and type(v) is int and 0 <= v < (1 << 63):
            out[k] = v
        elif t == "ints" and _ints_ok(v):
            out[k] = v
        else:
            out[k] = _check(t, v)
    return kind, out


# ---- typed failures on the wire -------------------------------------------------
# FAIL.code -> the error class the other side's handle fails with
CODES = {"invalid": InvalidDescriptor, "protocol": ProtocolError, "layout": LayoutMismatch,
         "limit": LimitExceeded}


def code_of(error: BaseException) -> str | None:
    """The FAIL code of ``error``, or None if the other side is told with a plain CANCEL."""
    for code, cls in CODES.items():
        if type(error) is cls:
            return code
    return None


def error_from(f: dict, who: str) -> KVXferError:
    """The typed error a received FAIL (``f``: code, reason) stands for."""
    cls = CODES.get(f["code"], ProtocolError)
    return cls(f"{who} failed {f['req']!r}: {f['reason']}")


def distinct_below(values, bound: int) -> bool:
    return bool(values) and len(set(values)) == len(values) and max(values) < bound
