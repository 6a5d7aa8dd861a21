"""Binary payloads of the messages on every request's path: RECV_POST, MATCHED, DATA_DONE.

Their fields are strings, integers, integer lists, a bool and a head range, so a
fixed little-endian layout, in schema order, replaces JSON (which cost most of
the per-message time of a 1-block request):

- ``int``: u64 (below 2**63); ``bool``: u8, 0 or 1; ``range``: two u32 ``a <= b < 2**31``;
- ``str``: u16 byte length, then UTF-8 (at most ``MAX_STR`` characters);
- ``ints``: u8 item width (2, 4 or 8), u32 count (at most ``MAX_LIST``), the items
  (each below 2**62).

:func:`decode_body` checks all of that and that nothing follows the last field;
any violation -- truncated, trailing or invalid bytes, a value out of range --
raises :class:`MalformedPayload` (a :class:`~kvxfer.errors.ProtocolError`) that
carries the fields decoded before it, so an authenticated peer's bad message can
fail the one request it names instead of the connection. What the values mean is
checked where they are used (:mod:`.checks`).
"""
from __future__ import annotations

import array
import struct
import sys

from ..errors import ProtocolError

MAX_STR = 256
MAX_LIST = 1 << 20

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


_INTS_CACHE: dict = {}


def _ints_cached(values) -> bytes:
    if type(values) is not tuple or len(values) > 256:
        return _ints_wire(values)
    raw = _INTS_CACHE.get(values)  # layer tuples repeat on every request: encode each once
    if raw is None:
        raw = _ints_wire(values)
        if len(_INTS_CACHE) >= 1024:
            _INTS_CACHE.clear()
        _INTS_CACHE[values] = raw
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
