"""The binary payloads of RECV_POST, MATCHED and DATA_DONE (kvxfer.agent.protocol):
every field round-trips, and any malformed payload is a ProtocolError, never
another exception or a half-decoded message."""
from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.framing import FrameReader
from kvxfer.agent.protocol import BINARY, Msg, decode, encode
from kvxfer.agent.protocol import MAX_LIST, MAX_STR
from kvxfer.errors import ProtocolError

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

POST = dict(req="réq-1", xid=(1 << 63) - 1, blocks=[0, 70000, 5], layers=list(range(30)), heads=(0, 3), skip=2)
DONE = dict(req="", xid=1, tag=0, pack=True, blocks=[(1 << 62) - 1, 0], layers=[], heads=(2, 2),
            offset=1 << 40, nbytes=368640)


def _payload(kind, **fields) -> bytes:
    (msg_type, payload), = FrameReader().feed(encode(kind, **fields))
    assert msg_type == kind
    return payload


@pytest.mark.parametrize("kind,fields", [(Msg.RECV_POST, POST), (Msg.DATA_DONE, DONE),
                                         (Msg.MATCHED, dict(req="x" * MAX_STR, xid=0))])
def test_roundtrip(kind, fields):
    assert kind in BINARY
    got_kind, got = decode(int(kind), _payload(kind, **fields))
    assert got_kind == kind and got == fields


def test_small_ids_take_two_bytes_each():
    small = _payload(Msg.RECV_POST, **{**POST, "blocks": list(range(1000))})
    assert len(small) < 2 * 1000 + 200


def _post_with(**over) -> bytes:
    return _payload(Msg.RECV_POST, **{**POST, **over})


def _patched(payload: bytes, at: int, raw: bytes) -> bytes:
    return payload[:at] + raw + payload[at + len(raw):]


def _bad_payloads():
    ok = _post_with(req="r", blocks=[1], layers=[0], heads=(0, 1), skip=0)
    # offsets in `ok`: req 0 (2+1), xid 3 (8), blocks 11 (1+4+2), layers 18 (1+4+2), heads 25 (8), skip 33 (8)
    yield ok[:-1]  # truncated
    yield ok + b"\0"  # trailing byte
    yield b""
    yield _patched(ok, 0, struct.pack("<H", 200))  # string longer than the payload
    yield _patched(ok, 2, b"\xff")  # invalid UTF-8
    yield _patched(ok, 3, struct.pack("<Q", 1 << 63))  # xid out of range
    yield _patched(ok, 11, b"\x03")  # item width 3
    yield _patched(ok, 12, struct.pack("<I", MAX_LIST + 1))  # too many items
    yield _patched(ok, 12, struct.pack("<I", 5))  # more items than bytes
    yield _patched(ok, 25, struct.pack("<II", 2, 1))  # range backwards
    yield _patched(ok, 25, struct.pack("<II", 0, 1 << 31))  # range too large
    w8 = _post_with(req="r", blocks=[1 << 40], layers=[0], heads=(0, 1), skip=0)
    yield _patched(w8, 16, struct.pack("<Q", 1 << 62))  # list item out of range
    yield _payload(Msg.RECV_POST, **{**POST, "req": "y" * (MAX_STR + 1)})  # string too long
    yield b'{"req":"r","xid":1,"blocks":[1],"layers":[0],"heads":[0,1],"skip":0}'  # JSON


@pytest.mark.parametrize("payload", list(_bad_payloads()))
def test_malformed_recv_post_is_a_protocol_error(payload):
    with pytest.raises(ProtocolError):
        decode(int(Msg.RECV_POST), payload)


def test_bool_must_be_zero_or_one():
    ok = _payload(Msg.DATA_DONE, **{**DONE, "req": "r"})
    at = 2 + 1 + 8 + 8  # req, xid, tag
    assert decode(int(Msg.DATA_DONE), ok)[1]["pack"] is True
    with pytest.raises(ProtocolError):
        decode(int(Msg.DATA_DONE), _patched(ok, at, b"\x02"))


@pytest.mark.parametrize("over", [dict(xid=-1), dict(xid=1 << 64), dict(blocks=[-1]), dict(blocks=[1 << 64]),
                                  dict(heads=(-1, 2)), dict(req=b"r"), dict(req="\udc80"), dict(layers=["1"])])
def test_unrepresentable_values_are_value_errors(over):
    with pytest.raises(ValueError):
        encode(Msg.RECV_POST, **{**POST, **over})


@FAST
@given(st.sampled_from(sorted(BINARY)), st.binary(max_size=200))
def test_fuzz_binary_payloads(kind, payload):
    try:
        decode(int(kind), payload)
    except ProtocolError:
        pass


@FAST
@given(st.integers(0, 20), st.binary(min_size=1, max_size=4))
def test_fuzz_corrupted_data_done(at, raw):
    good = _payload(Msg.DATA_DONE, **{**DONE, "req": "r", "layers": [0, 1]})
    try:
        kind, fields = decode(int(Msg.DATA_DONE), _patched(good, at, raw))
    except ProtocolError:
        return
    assert kind == Msg.DATA_DONE and set(fields) == set(DONE)
