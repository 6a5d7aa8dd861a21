"""The store's request/reply messages, after the agents' handshake authenticated a client.

Frames are kvxfer's one frame codec (:mod:`kvxfer.framing`) with a JSON
payload. A request's ``keys`` travel in binary after the JSON, past a NUL byte, back to
back, with their lengths in the JSON's ``keys`` (:func:`pack_keys`), so that 64 keys cost
one join to encode and one slice each to parse. Every request carries an ``id`` that its reply repeats.
A node answers every request except RELEASE (fire-and-forget, applied in order):

====================  ===========================================================  =====================================
request               fields                                                       reply fields
====================  ===========================================================  =====================================
LOOKUP                ``keys``                                                     ``present``: ``"1101..."`` per key
RESERVE               ``keys``, ``nbytes``, ``fmt``                                ``r``: ``[[code, offset, token], ...]``
RESERVE_PART          ``keys``, ``nbytes``, ``fmt``, ``heads``: ``[lo, hi, of]``   ``r``: ``[[code, offset, token], ...]``
COMMIT                ``keys``, ``tokens``, ``crcs``                               ``ok``: ``[bool, ...]``
ABORT                 ``keys``, ``tokens``                                         (empty)
GET                   ``keys``, ``fmt``                                            ``r``: ``[[offset, nbytes, crc, pin], ...]`` (pin 0: miss)
RELEASE               ``pins``, ``bad`` (the pins whose bytes failed the checksum)  none
STATS                 (none)                                                       the node's counters
SPARE                 ``count``, ``evict``, ``nbytes``                             ``s``: ``[[offset, token], ...]``, ``lease_s``
COMMIT_SPARE          ``keys``, ``tokens``, ``crcs``, ``nbytes``, ``fmt``          ``r``: ``[code, ...]``
====================  ===========================================================  =====================================

SPARE reserves up to ``count`` chunks for objects of ``nbytes`` for the client under no
key, from the chunks free now only (a spare never costs an object: ``evict`` is accepted
and ignored), fewer when none is free or the client is at its quotas
(:mod:`kvxfer.store.quotas`), each held for ``lease_s`` seconds (short: spares are for
clients that are putting); a
COMMIT_SPARE makes the bytes the client wrote into its spare ``tokens[i]`` the object
``keys[i]`` (codes :data:`COMMITTED`, :data:`PRESENT`, :data:`BUSY`, :data:`NO_SPARE`,
:data:`REFUSED`; a token 0 asks only whether the key is present, and refreshes it
if so). A client that holds spares puts with one round trip instead of two.

RESERVE_PART reserves heads ``[lo, hi)`` of ``of`` of each key's object (``nbytes``: the
whole object) for one rank of a TP group; its codes are RESERVE's plus :data:`CONFLICT`. A GET's ``crc`` is one int for an object put whole, and
``[[lo, hi, crc], ...]`` (head order, covering ``[0, of)``) for one put in parts: each
part's checksum over its own heads' bytes in wire order.

A ``fmt`` names the object's size (:func:`format_tag`: ``"{model tag}/{nbytes}"``): a
RESERVE, RESERVE_PART or COMMIT_SPARE whose ``nbytes`` is not the size its ``fmt`` names
is refused (``bad_request``), so no object is ever held at a size its readers do not expect.

A request that fails validation (unknown type, missing, extra or mistyped field, a key
of 0 or over 64 bytes, too many keys, a head range that is not ``0 <= lo < hi <= of <=``
:data:`MAX_HEADS`, a frame over :data:`MAX_REQUEST_BYTES`) gets
``{"id": ..., "error": code, "reason": ...}`` and nothing else happens: the connection
and every other request go on. An oversize frame's payload is skipped unread.
"""
from __future__ import annotations

import enum
import json

from ..framing import HEADER, MAGIC, PROTOCOL_VERSION, encode_frame
from ..errors import ProtocolError
from .keys import MAX_KEY_BYTES

__all__ = ["Req", "REPLY", "MAX_KEYS", "MAX_HEADS", "MAX_REQUEST_BYTES", "NO_CRC", "RequestReader", "encode", "parse_request",
           "format_tag", "format_nbytes", "STORE_INFO", "CLIENT_INFO", "PRESENT", "RESERVED", "BUSY", "FULL", "LIMIT",
           "CONFLICT", "COMMITTED", "NO_SPARE", "REFUSED"]

# the "layout" kind each side names in its handshake INFO: a node's, and a client's
STORE_INFO = "kvxfer-store"
CLIENT_INFO = "kvxfer-store-client"

# per-key codes of RESERVE and RESERVE_PART replies (PRESENT, RESERVED, BUSY, FULL, LIMIT,
# CONFLICT) and of COMMIT_SPARE replies (COMMITTED, PRESENT, BUSY, NO_SPARE, REFUSED: no
# checksum where the node requires one); the outcomes of kvxfer.store.index.SlotIndex
PRESENT, RESERVED, BUSY, FULL, LIMIT, CONFLICT, COMMITTED, NO_SPARE, REFUSED = range(9)

MAX_KEYS = 4096  # keys (or pins) one request may name
MAX_REQUEST_BYTES = 1 << 20  # 4096 keys of 64 bytes fit with room to spare
MAX_FMT = 64
MAX_HEADS = 4096  # the kv heads a multi-part object may have (so: at most this many parts)
NO_CRC = 2**64 - 1  # the checksum of an object put without one (KVStore(checksum=False))


def format_tag(model: str, nbytes: int) -> str:
    """The ``fmt`` of objects of ``nbytes`` bytes of the model tagged ``model`` (hex):
    ``"{model}/{nbytes}"``. A node holds an object only at the size its format names."""
    return f"{model}/{int(nbytes)}"


def format_nbytes(fmt: str) -> int | None:
    """The object size a ``fmt`` of :func:`format_tag` names (None: it names none)."""
    _, sep, size = fmt.rpartition("/")
    if not sep or not size.isdigit() or len(size) > 15:
        return None
    return int(size)


class Req(enum.IntEnum):
    LOOKUP = 64
    RESERVE = 65
    COMMIT = 66
    ABORT = 67
    GET = 68
    RELEASE = 69
    STATS = 70
    RESERVE_PART = 71
    SPARE = 72
    COMMIT_SPARE = 73


REPLY = 80

_SCHEMAS = {
    Req.LOOKUP: {"keys": "keys"},
    Req.RESERVE: {"keys": "keys", "nbytes": "size", "fmt": "fmt"},
    Req.RESERVE_PART: {"keys": "keys", "nbytes": "size", "fmt": "fmt", "heads": "heads"},
    Req.COMMIT: {"keys": "keys", "tokens": "ints", "crcs": "crcs"},
    Req.ABORT: {"keys": "keys", "tokens": "ints"},
    Req.GET: {"keys": "keys", "fmt": "fmt"},
    Req.RELEASE: {"pins": "ints", "bad": "ints"},
    Req.STATS: {},
    Req.SPARE: {"count": "count", "evict": "bool", "nbytes": "size"},
    Req.COMMIT_SPARE: {"keys": "keys", "tokens": "ints", "crcs": "crcs", "nbytes": "size", "fmt": "fmt"},
}


def pack_keys(keys) -> tuple:
    """``keys`` (``bytes`` of 1..64) as ``(lengths, raw)``: ``raw`` the keys back to back,
    ``lengths`` one int when every key has it (chained block keys do), else one per key."""
    sizes = {len(k) for k in keys}
    lengths = sizes.pop() if len(sizes) == 1 else [len(k) for k in keys]
    return lengths, b"".join(keys)


def unpack_keys(lengths, raw: bytes) -> list:
    """The keys of a :func:`pack_keys` pair; :class:`ProtocolError` unless it is well
    formed (1..64-byte keys, at most :data:`MAX_KEYS`, nothing left over)."""
    def bad(why: str):
        return ProtocolError(f"field 'keys': {why}")

    if len(raw) > MAX_KEYS * MAX_KEY_BYTES:
        raise bad(f"more than {MAX_KEYS} keys of {MAX_KEY_BYTES} bytes")
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        if not 0 < lengths <= MAX_KEY_BYTES or len(raw) % lengths:
            raise bad(f"a key must be 1..{MAX_KEY_BYTES} bytes")
        out = [raw[i:i + lengths] for i in range(0, len(raw), lengths)]
    elif isinstance(lengths, list):
        out, pos = [], 0
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_KEY_BYTES:
                raise bad(f"a key must be 1..{MAX_KEY_BYTES} bytes")
            out.append(raw[pos:pos + n])
            pos += n
        if pos != len(raw):
            raise bad("lengths do not add up to the bytes")
    else:
        raise bad("lengths must be an int or a list of ints")
    if len(out) > MAX_KEYS:
        raise bad(f"{len(out)} items exceed {MAX_KEYS}")
    return out


def encode(msg_type: int, obj: dict) -> bytes:
    """One frame: ``obj`` as JSON; with ``keys`` (``bytes``), their lengths in the JSON
    and the keys themselves after it, past a NUL byte (:func:`pack_keys`)."""
    body = b""
    if "keys" in obj:
        lengths, raw = pack_keys(obj["keys"])
        obj, body = {**obj, "keys": lengths}, b"\0" + raw
    return encode_frame(int(msg_type), json.dumps(obj, separators=(",", ":")).encode() + body, MAX_REQUEST_BYTES)


def _check(name: str, kind: str, value):
    def bad(why: str):
        return ProtocolError(f"field {name!r}: {why}")

    if kind == "keys":
        return unpack_keys(*value)
    if kind in ("ints", "crcs"):
        if not isinstance(value, list):
            raise bad("must be a list")
        if len(value) > MAX_KEYS:
            raise bad(f"{len(value)} items exceed {MAX_KEYS}")
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
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("must be true or false")
        return value
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_KEYS:
            raise bad(f"must be an int in 1..{MAX_KEYS}")
        return value
    if kind == "heads":
        if (not isinstance(value, list) or len(value) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) for v in value)):
            raise bad("must be [lo, hi, of] (ints)")
        lo, hi, of = value
        if not 0 <= lo < hi <= of <= MAX_HEADS:
            raise bad(f"need 0 <= lo < hi <= of <= {MAX_HEADS}, got {value}")
        return value
    if kind == "fmt":
        if not isinstance(value, str) or len(value) > MAX_FMT:
            raise bad(f"must be a string of at most {MAX_FMT} chars")
        return value
    raise AssertionError(kind)


def parse_request(msg_type: int, payload: bytes) -> tuple[Req, int, dict]:
    """``(type, id, fields)`` of a well-formed request, else :class:`ProtocolError`
    (with ``.request_id`` set when the id could be read)."""
    payload = bytes(payload)
    cut = payload.find(b"\0")  # JSON never holds a raw NUL: the keys follow the first one
    head, raw = (payload, None) if cut < 0 else (payload[:cut], payload[cut + 1:])
    try:
        obj = json.loads(head)
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
        if ("keys" in schema) != (raw is not None):
            raise ProtocolError(f"{kind.name}: keys after a NUL byte " + ("missing" if raw is None else "not expected"))
        if raw is not None:
            obj["keys"] = (obj["keys"], raw)
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
