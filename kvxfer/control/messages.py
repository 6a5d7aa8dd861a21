"""Control message types and their strict schemas.

Every message carries exactly the schema's fields, each of the declared kind:
a JSON object, except the three on every request's path (RECV_POST, MATCHED,
DATA_DONE), which use the binary layout of :mod:`.wire`. :func:`decode` is the
only way bytes from a peer become a message; anything else -- unknown type,
invalid UTF-8/JSON/binary, a missing, extra or mistyped field, a negative id --
raises :class:`~kvxfer.errors.ProtocolError`; for the binary ones a
:class:`~.wire.MalformedPayload` that says which message it was (``kind``) and
holds the fields before the bad one.
"""
from __future__ import annotations

import base64
import binascii
import enum
import json

from ..errors import ProtocolError
from .framing import encode_frame
from .wire import MAX_LIST, MAX_STR, MalformedPayload, decode_body, encode_body


class Msg(enum.IntEnum):
    # handshake (connecting side C, accepting side S), in order
    HELLO = 1        # C->S: nonce_c
    CHALLENGE = 2    # S->C: nonce_s
    AUTH = 3         # C->S: HMAC(secret, "C" | nonce_s | nonce_c)
    AUTH_OK = 4      # S->C: HMAC(secret, "S" | nonce_c | nonce_s)
    AUTH_FAIL = 5    # S->C, then close
    INFO = 6         # both ways, only after AUTH_OK: name, layout, backend metadata
    REJECT = 7       # either way, then close: layout mismatch etc.
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


_NONCE = "hex32"
SCHEMAS: dict[Msg, dict[str, str]] = {
    Msg.HELLO: {"nonce": _NONCE},
    Msg.CHALLENGE: {"nonce": _NONCE},
    Msg.AUTH: {"mac": _NONCE},
    Msg.AUTH_OK: {"mac": _NONCE},
    Msg.AUTH_FAIL: {},
    Msg.INFO: {"name": "str", "agent_id": "str", "layout": "obj", "backend": "b64",
               "staging": "int"},
    Msg.REJECT: {"code": "str", "reason": "str"},
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


def _ints_ok(value) -> bool:
    # json only yields int, float, bool, str, None, list, dict: one type check over the
    # whole list in C (bool is its own type), then the range from min/max
    return (type(value) is list and len(value) <= MAX_LIST
            and (not value or (set(map(type, value)) == {int} and min(value) >= 0 and max(value) < (1 << 62))))


def _check(kind: str, value):
    """Return the validated (and for b64, decoded) value or raise ProtocolError."""
    if kind == "int":
        if type(value) is int and 0 <= value < (1 << 63):
            return value
    elif kind == "str":
        if type(value) is str and len(value) <= MAX_STR:
            return value
    elif kind == "ints":
        if _ints_ok(value):
            return value
    elif kind == "range":
        if (type(value) is list and len(value) == 2 and type(value[0]) is int and type(value[1]) is int
                and 0 <= value[0] <= value[1] < (1 << 31)):
            return (value[0], value[1])
    elif kind == "bool":
        if type(value) is bool:
            return value
    elif kind == "hex32":
        if type(value) is str and len(value) == 64:
            try:
                return bytes.fromhex(value)
            except ValueError:
                pass
    elif kind == "b64":
        if type(value) is str:
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                pass
    elif kind == "obj":
        if type(value) is dict:
            return value
    raise ProtocolError(f"field of kind {kind} has an invalid value")


def _wire(kind: str, value):
    if kind == "hex32":
        return bytes(value).hex()
    if kind == "b64":
        return base64.b64encode(bytes(value)).decode("ascii")
    if kind == "ints":
        return list(map(int, value))
    if kind == "range":
        return [int(value[0]), int(value[1])]
    return value


# one encoder, built once (json.dumps with separators builds a new one per call)
_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)
_SCHEMA_ITEMS = {t: tuple(s.items()) for t, s in SCHEMAS.items()}
BINARY = frozenset((Msg.RECV_POST, Msg.MATCHED, Msg.DATA_DONE))  # payloads in the layout of .wire
_PASS = frozenset(("int", "str", "bool", "obj"))  # encoded as given


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
