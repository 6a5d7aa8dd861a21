"""The field kinds of kvxfer's JSON control messages, and their strict checks.

A control message's payload is a JSON object with exactly its schema's fields
(``{field: kind}``), each of one kind:

- ``int``: an int in ``[0, 2**63)``; ``str``: at most :data:`MAX_STR` characters;
- ``ints``: a list of at most :data:`MAX_LIST` ints in ``[0, 2**62)``;
- ``range``: ``[a, b]`` with ``0 <= a <= b < 2**31`` (decoded as a tuple);
- ``bool``; ``obj``: a JSON object (checked where it is used);
- ``hex32``: 32 bytes as 64 hex digits; ``b64``: bytes as base64 (both decoded to bytes).

:func:`encode_json` / :func:`decode_json` are the whole codec for such a payload;
anything else -- invalid UTF-8 or JSON, a missing, extra or mistyped field -- raises
:class:`~kvxfer.errors.ProtocolError`. The handshake's messages (:mod:`kvxfer.auth`)
and the agents' (:mod:`kvxfer.agent.protocol`, which adds a binary layout and fast
paths for its per-request messages) are both written in these kinds.
"""
from __future__ import annotations

import base64
import binascii
import json

from .errors import ProtocolError

__all__ = ["MAX_STR", "MAX_LIST", "ENCODER", "check", "ints_ok", "wire", "encode_json", "decode_json"]

MAX_STR = 256
MAX_LIST = 1 << 20
# one encoder, built once (json.dumps with separators builds a new one per call)
ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)
PASS = frozenset(("int", "str", "bool", "obj"))  # kinds whose wire form is the value itself


def ints_ok(value) -> bool:
    # json only yields int, float, bool, str, None, list, dict: one type check over the
    # whole list in C (bool is its own type), then the range from min/max
    return (type(value) is list and len(value) <= MAX_LIST
            and (not value or (set(map(type, value)) == {int} and min(value) >= 0 and max(value) < (1 << 62))))


def check(kind: str, value):
    """Return the validated (for ``hex32``/``b64``: decoded, ``range``: tuple) value of
    one field of ``kind``, or raise ProtocolError."""
    if kind == "int":
        if type(value) is int and 0 <= value < (1 << 63):
            return value
    elif kind == "str":
        if type(value) is str and len(value) <= MAX_STR:
            return value
    elif kind == "ints":
        if ints_ok(value):
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


def wire(kind: str, value):
    """The JSON value of one field of ``kind`` (the inverse of :func:`check`)."""
    if kind == "hex32":
        return bytes(value).hex()
    if kind == "b64":
        return base64.b64encode(bytes(value)).decode("ascii")
    if kind == "ints":
        return list(map(int, value))
    if kind == "range":
        return [int(value[0]), int(value[1])]
    return value


def encode_json(name: str, schema: dict, fields: dict) -> bytes:
    """The JSON payload of message ``name``; ``fields`` must match ``schema`` exactly (else ValueError)."""
    if fields.keys() != schema.keys():
        raise ValueError(f"{name} takes fields {sorted(schema)}, got {sorted(fields)}")
    body = {k: v if kind in PASS else wire(kind, v) for k, v in fields.items() for kind in (schema[k],)}
    return ENCODER.encode(body).encode()


def decode_json(name: str, schema: dict, payload: bytes) -> dict:
    """The checked fields of message ``name`` (``schema``: ``{field: kind}``) from ``payload``."""
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError(f"{name}: payload is not JSON") from None
    if type(body) is not dict or body.keys() != schema.keys():
        raise ProtocolError(f"{name}: fields do not match the schema")
    return {k: check(t, body[k]) for k, t in schema.items()}
