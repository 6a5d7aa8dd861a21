"""Framing, message schemas and the server handshake reject any malformed input
with ProtocolError (or AuthenticationError), never anything else."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer import secrets as kvsecrets
from kvxfer import auth
from kvxfer.framing import HEADER, MAX_PAYLOAD, FrameReader, encode_frame
from kvxfer.auth import ServerHandshake
from kvxfer.agent.protocol import SCHEMAS, Msg, decode, encode
from kvxfer.errors import AuthenticationError, KVXferError, LayoutMismatch, ProtocolError
from kvxfer.transport.descriptors import Geometry

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_roundtrip_every_message_type():
    samples = {"hex32": b"\x01" * 32, "int": 7, "bool": True, "str": "req-1", "b64": b"\x00\xffkeys",
               "ints": [3, 0, 9], "range": (0, 4), "obj": {"a": 1}}
    for kind, schema in SCHEMAS.items():
        frame = encode(kind, **{k: samples[v] for k, v in schema.items()})
        (msg_type, payload), = FrameReader().feed(frame)
        got_kind, fields = decode(msg_type, payload)
        assert got_kind == kind
        assert fields == {k: samples[v] for k, v in schema.items()}


def test_reader_handles_split_and_merged_frames():
    frames = [encode(Msg.ACK, tag=i) for i in range(5)]
    stream = b"".join(frames)
    reader, got = FrameReader(), []
    for i in range(len(stream)):
        got += reader.feed(stream[i:i + 1])
    assert [decode(*f)[1]["tag"] for f in got] == list(range(5))
    assert reader.pending_bytes == 0


@pytest.mark.parametrize("header", [b"XX\x01\x0f\x00\x00\x00\x00", b"KX\x09\x0f\x00\x00\x00\x00",
                                    HEADER.pack(b"KX", 1, 15, MAX_PAYLOAD + 1)])
def test_bad_header_rejected_before_payload(header):
    with pytest.raises(ProtocolError):
        FrameReader().feed(header)


@pytest.mark.parametrize("body", [b"\xff\xfe", b"[1,2]", b'{"tag": -1}', b'{"tag": 1, "x": 2}', b'{"tag": "1"}',
                                  b'{"tag": true}', b"{" * 5000, b'{"tag": 1e3}'])
def test_schema_violations(body):
    with pytest.raises(ProtocolError):
        decode(int(Msg.ACK), body)


def test_unknown_type_and_encode_checks():
    with pytest.raises(ProtocolError):
        decode(200, b"{}")
    with pytest.raises(ValueError):
        encode(Msg.ACK, tag=1, extra=2)
    with pytest.raises(ValueError):
        encode_frame(1, b"x" * (MAX_PAYLOAD + 1))


@FAST
@given(st.binary(max_size=300))
def test_fuzz_reader_and_decoder(data):
    try:
        for msg_type, payload in FrameReader().feed(data):
            decode(msg_type, payload)
    except ProtocolError:
        pass


@FAST
@given(st.sampled_from(list(Msg)), st.dictionaries(st.sampled_from(["nonce", "mac", "req", "tag", "blocks",
                                                                     "layout", "heads", "xid", "data"]),
                                                    st.one_of(st.integers(-5, 2**70), st.text(max_size=70),
                                                              st.lists(st.integers(-2, 9), max_size=4),
                                                              st.none(), st.booleans()), max_size=6))
def test_fuzz_structured_messages(kind, body):
    payload = json.dumps(body).encode()
    try:
        decode(int(kind), payload)
    except ProtocolError:
        pass


def _server(secret=b"s"):
    return ServerHandshake(secret, lambda: {"name": "srv"}, lambda fields: None)


def test_server_handshake_wrong_secret_learns_nothing():
    hs = _server(b"right")
    frames, ready = hs.on_frame(Msg.HELLO, {"nonce": b"\x01" * 32})
    (msg_type, payload), = FrameReader().feed(frames[0])
    kind, fields = decode(msg_type, payload)
    assert kind == Msg.CHALLENGE and set(fields) == {"nonce"}  # a random nonce, nothing else
    bad = auth.AGENT_CHALLENGE.client_mac(b"wrong", fields["nonce"], b"\x01" * 32)
    with pytest.raises(AuthenticationError):
        hs.on_frame(Msg.AUTH, {"mac": bad})
    assert decode(*FrameReader().feed(hs.reply_on_error)[0])[0] == Msg.AUTH_FAIL


def test_server_handshake_out_of_order():
    with pytest.raises(ProtocolError):
        _server().on_frame(Msg.INFO, {})
    hs = _server()
    hs.on_frame(Msg.HELLO, {"nonce": b"\x02" * 32})
    with pytest.raises(ProtocolError):
        hs.on_frame(Msg.HELLO, {"nonce": b"\x02" * 32})


@FAST
@given(st.lists(st.tuples(st.sampled_from(list(Msg)), st.binary(max_size=40)), max_size=5))
def test_fuzz_handshake_sequences(steps):
    hs = _server()
    try:
        for kind, blob in steps:
            fields = {k: (blob[:32].ljust(32, b"\0") if v == "hex32" else blob if v == "b64" else 1)
                      for k, v in SCHEMAS[kind].items()}
            hs.on_frame(kind, fields)
    except (ProtocolError, AuthenticationError):
        pass


def _geometry_wire():
    return {"fingerprint": "fp", "num_layers": 1, "num_kv": 2, "num_blocks": 4, "block_size": 2,
            "num_heads": 1, "head_dim": 4, "itemsize": 2, "head_lo": 0,
            "planes": [[0, 0, 16, 8, 8, 2], [0, 64, 16, 8, 8, 2]], "region_sizes": [128]}


def test_geometry_wire_validation():
    g = Geometry.from_wire(_geometry_wire())
    assert Geometry.from_wire(g.to_wire()) == g
    for patch in ({"planes": [[0, 0, 16, 8, 8, 2], [0, 100, 16, 8, 8, 2]]},  # outside its region
                  {"num_blocks": -1}, {"planes": "x"}, {"region_sizes": [0]}, {"extra": 1},
                  {"planes": [[1, 0, 16, 8, 8, 2], [0, 64, 16, 8, 8, 2]]}):
        with pytest.raises(ProtocolError):
            Geometry.from_wire({**_geometry_wire(), **patch})
    other = Geometry.from_wire({**_geometry_wire(), "fingerprint": "other"})
    with pytest.raises(LayoutMismatch):
        g.check_compatible(other)


@FAST
@given(st.dictionaries(st.sampled_from(list(_geometry_wire())), st.one_of(
    st.integers(-3, 2**41), st.lists(st.lists(st.integers(-1, 200), max_size=7), max_size=3), st.text(max_size=3))))
def test_fuzz_geometry(patch):
    try:
        Geometry.from_wire({**_geometry_wire(), **patch})
    except ProtocolError:
        pass
    except KVXferError as exc:  # pragma: no cover - any other error class is a bug
        raise AssertionError(exc)


def test_secret_normalization():
    assert kvsecrets.normalize_secret("abc" * 6) == b"abc" * 6
    for short in (b"", "abc", b"x" * (kvsecrets.MIN_SECRET_BYTES - 1)):
        with pytest.raises(ValueError):
            kvsecrets.normalize_secret(short)
    with pytest.raises(TypeError):
        kvsecrets.normalize_secret(None)
