"""Argument checks at the agent's calls: block ids go
through one strict validator (integers only), request ids must fit the wire, and
timeouts must be finite and > 0. A refused call raises ValueError/TypeError and
changes nothing: no lease, no RECV_POST on the peer."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import kvxfer
from kvxfer import Agent, AgentConfig
from kvxfer.runs import check_block_ids

from agent_procs import SECRET, loopback_pair

T = 20.0
N = 32  # agent_procs.SHAPE

BAD_IDS = [
    ([1.7, 2.2], TypeError), (["3"], TypeError), ("3", TypeError), ([True], TypeError), (True, TypeError),
    ([np.bool_(True)], TypeError), ([1e20], TypeError), (1.0, TypeError), ({1, 2}, TypeError),
    (np.array([1.0, 2.0]), TypeError), (np.array([True]), TypeError), (torch.tensor([1.0]), TypeError),
    (torch.tensor([True]), TypeError), ([None], TypeError),
    ([10**20], ValueError), ([2**64], ValueError), ([-1], ValueError), ([N], ValueError),
    (np.array([2**64 - 1], dtype=np.uint64), ValueError), (np.array([[1, 2]]), ValueError),
    (torch.tensor([N]), ValueError),
]
GOOD_IDS = [[3, 4], (3, 4), range(3, 5), np.array([3, 4], dtype=np.int32), np.array([3, 4], dtype=np.uint8),
            [np.int64(3), np.int16(4)], torch.tensor([3, 4]), torch.tensor([3, 4], dtype=torch.int32)]


def _nothing_changed(p, d, peer) -> None:
    """No lease on either side and no RECV_POST left on P: a good transfer on the same
    connection (posted after anything the refused call could have sent) comes through."""
    hr = d.recv("probe", [30], timeout=T)
    p.send(peer, "probe", [31]).wait(T)
    hr.wait(T)
    assert p.pending_recvs() == [] and p.held_blocks() == {} and d.held_blocks() == {}


@pytest.mark.parametrize("ids,exc", BAD_IDS, ids=[f"{type(i).__name__}-{e.__name__}-{n}" for n, (i, e) in
                                                   enumerate(BAD_IDS)])
def test_bad_block_ids_refused_by_every_entry_point(ids, exc):
    with loopback_pair() as (p, d, peer, src, dst):
        calls = [lambda: d.recv("r", ids, timeout=T), lambda: p.send(peer, "r", ids),
                 lambda: p.send(None, "r", ids), lambda: p.send_layer(peer, "r", 0, ids),
                 lambda: p.write(peer, ids, [1, 2]), lambda: p.write(peer, [1, 2], ids),
                 lambda: p.read(peer, ids, [1, 2]), lambda: p.read(peer, [1, 2], ids),
                 lambda: kvxfer.pack(src, ids), lambda: kvxfer.unpack(dst, torch.zeros(1 << 16, dtype=torch.uint8),
                                                                   ids)]
        for call in calls:
            with pytest.raises(exc):
                call()
        _nothing_changed(p, d, peer)
        assert not kvxfer.pack(dst, list(range(30)), backend="reference").any()  # nothing written


@pytest.mark.parametrize("ids", GOOD_IDS, ids=lambda i: type(i).__name__)
def test_integer_block_ids_of_every_kind_are_taken(ids):
    with loopback_pair() as (p, d, peer, src, dst):
        hr = d.recv("r", ids, timeout=T)
        p.send(peer, "r", np.array([7, 8])).wait(T)
        hr.wait(T)
        assert torch.equal(kvxfer.pack(src, [7, 8], backend="reference"), kvxfer.pack(dst, ids, backend="reference"))
        assert [int(b) for b in check_block_ids(ids, N, unique=True)] == [3, 4]


def test_no_blocks_refused_by_the_agent():
    with loopback_pair() as (p, d, peer, src, dst):
        for call in (lambda: d.recv("r", [], timeout=T), lambda: p.send(peer, "r", np.array([], dtype=np.int64)),
                     lambda: p.write(peer, [], [])):
            with pytest.raises(ValueError, match="empty"):
                call()
        _nothing_changed(p, d, peer)
        assert kvxfer.pack(src, []).numel() == 0  # pack and unpack take no blocks: zero bytes


def test_duplicates_refused_where_blocks_are_written():
    with loopback_pair() as (p, d, peer, src, dst):
        for call in (lambda: d.recv("r", [3, 3], timeout=T), lambda: p.write(peer, [1, 2], [5, 5]),
                     lambda: p.read(peer, [5, 5], [1, 2]),
                     lambda: kvxfer.unpack(dst, torch.zeros(1 << 16, dtype=torch.uint8), [3, 3])):
            with pytest.raises(ValueError, match="duplicates"):
                call()
        _nothing_changed(p, d, peer)
        hr = d.recv("s", [3, 4], timeout=T)  # a send may name a source block twice
        p.send(peer, "s", [6, 6]).wait(T)
        hr.wait(T)
        assert torch.equal(kvxfer.pack(src, [6, 6], backend="reference"), kvxfer.pack(dst, [3, 4], backend="reference"))


@pytest.mark.parametrize("req,exc,match", [
    ("x" * 257, ValueError, "at most 256"), ("", ValueError, "empty"), ("\ud800", ValueError, "UTF-8"),
    (7, TypeError, "str"), (b"r", TypeError, "str"), (None, TypeError, "str"),
])
def test_bad_request_ids_refused_at_the_call(req, exc, match):
    with loopback_pair() as (p, d, peer, src, dst):
        for call in (lambda: d.recv(req, [3], timeout=T), lambda: p.send(peer, req, [3]),
                     lambda: p.send(None, req, [3]), lambda: p.send_layer(peer, req, 0, [3])):
            with pytest.raises(exc, match=match):
                call()
        _nothing_changed(p, d, peer)


def test_request_id_of_256_characters_goes_through():
    with loopback_pair() as (p, d, peer, src, dst):
        req = "é" * 256  # 256 characters, 512 bytes of UTF-8
        hr = d.recv(req, [3], timeout=T)
        p.send(peer, req, [4]).wait(T)
        hr.wait(T)
        assert torch.equal(kvxfer.pack(src, [4], backend="reference"), kvxfer.pack(dst, [3], backend="reference"))


BAD_TIMEOUTS = [(-1, ValueError), (0, ValueError), (0.0, ValueError), (math.nan, ValueError),
                (math.inf, ValueError), (-math.inf, ValueError), (True, TypeError), ("1", TypeError)]


@pytest.mark.parametrize("value,exc", BAD_TIMEOUTS, ids=repr)
def test_bad_timeouts_refused_and_nothing_leased(value, exc):
    with loopback_pair() as (p, d, peer, src, dst):
        hr = d.recv("ok", [5], timeout=T)
        hs = p.send(peer, "ok", [5])
        for call in (lambda: d.recv("r", [3], timeout=value), lambda: p.send(peer, "r", [3], lease_timeout=value),
                     lambda: p.send_layer(peer, "r", 0, [3], lease_timeout=value),
                     lambda: hr.wait(value), lambda: hs.wait(value), lambda: hr.wait(value, layer=0),
                     lambda: p.connect(d.address, timeout=value)):
            with pytest.raises(exc):
                call()
        hr.wait(T)
        hs.wait(T)
        _nothing_changed(p, d, peer)
        with pytest.raises((ValueError, TypeError)):
            AgentConfig(lease_timeout=value)


def test_a_timed_out_recv_leaves_no_lease():
    released = []
    with loopback_pair() as (p, d, peer, src, dst):
        d.leases._on_release = lambda r, b, why: released.append((r, b, why))
        hr = d.recv("t", [5], timeout=0.05)  # P holds the post and never sends
        with pytest.raises(kvxfer.TransferTimeout):
            hr.wait(T)
        deadline = time.monotonic() + T  # P's CANCEL_ACK releases the blocks
        while d.held_blocks() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert d.held_blocks() == {} and released == [("t", (5,), "expired")]
        hs = p.send(peer, "u", [5], lease_timeout=0.05)  # nobody asks for "u"
        with pytest.raises(kvxfer.TransferTimeout):
            hs.wait(T)
        assert p.held_blocks() == {}
        _nothing_changed(p, d, peer)
