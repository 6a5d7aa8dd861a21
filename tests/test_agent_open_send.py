"""Agent API for engines whose prefill side does not know the decode side:
``send(None, ...)`` (whoever posts the id), ``pending_recvs()``, and tail
transfers (``recv(..., skip_blocks=k)``: D holds a prefix already)."""
from __future__ import annotations

import threading

import pytest
import torch

import kvxfer
from kvxfer import Agent
from kvxfer.errors import InvalidDescriptor, TransferCancelled

from agent_procs import SECRET, make_pool

T = 20.0


def trio():
    """P plus two D agents, both connected to P (D connects, as a vLLM consumer does)."""
    pl = make_pool("2 N B H D", 1, dtype="float16")
    agents = [Agent(n, secret=SECRET, backend="loopback") for n in ("p", "d0", "d1")]
    layouts = [pl] + [make_pool("2 N B H D", None, dtype="float16") for _ in range(2)]
    for a, lay in zip(agents, layouts):
        a.register_kv(lay)
    for d in agents[1:]:
        d.connect(agents[0].address)
    return agents, layouts


def close(agents):
    for a in agents:
        a.close()


def same(src_layout, src_ids, dst_layout, dst_ids) -> bool:
    return torch.equal(kvxfer.pack(src_layout, src_ids, backend="reference"),
                       kvxfer.pack(dst_layout, dst_ids, backend="reference"))


@pytest.mark.parametrize("send_first", [True, False])
def test_send_to_whoever_posts(send_first):
    (p, d0, d1), (pl, dl0, dl1) = trio()
    try:
        if send_first:
            hs = p.send(None, "r", [3, 9, 1])
            assert hs.peer is None and not hs.done()
        hr = d1.recv("r", [5, 6, 7], timeout=T)
        if not send_first:
            deadline = __import__("time").monotonic() + T
            while not p.pending_recvs() and __import__("time").monotonic() < deadline:
                __import__("time").sleep(0.01)
            ((peer, req, n),) = p.pending_recvs()
            assert (peer.name, req, n) == ("d1", "r", 3)
            hs = p.send(None, "r", [3, 9, 1])
        hs.wait(T)
        hr.wait(T)
        assert hs.peer == "d1" and same(pl, [3, 9, 1], dl1, [5, 6, 7])
        assert not kvxfer.pack(dl0, list(range(dl0.num_blocks)), backend="reference").any()
        assert p.held_blocks() == {} and p.pending_recvs() == []
    finally:
        close((p, d0, d1))


def test_tail_only_moves_the_tail():
    (p, d0, d1), (pl, dl0, _) = trio()
    try:
        before = kvxfer.pack(dl0, [2, 4], backend="reference").clone()
        hr = d0.recv("t", [11, 12], skip_blocks=2, timeout=T)
        hs = p.send(None, "t", [3, 9, 1, 8])
        hs.wait(T)
        hr.wait(T)
        assert same(pl, [1, 8], dl0, [11, 12])
        assert torch.equal(kvxfer.pack(dl0, [2, 4], backend="reference"), before)
        assert hr.nbytes == 2 * dl0.num_layers * dl0.block_nbytes()
    finally:
        close((p, d0, d1))


def test_tail_count_mismatch_is_a_typed_failure():
    (p, d0, d1), _ = trio()
    try:
        hr = d0.recv("m", [11, 12], skip_blocks=1, timeout=T)
        hs = p.send(None, "m", [3, 9, 1, 8])
        with pytest.raises(InvalidDescriptor):
            hs.wait(T)
        with pytest.raises((TransferCancelled, InvalidDescriptor)):
            hr.wait(T)
        assert p.held_blocks() == {}
        with pytest.raises(ValueError):
            d0.recv("bad", [1], skip_blocks=-1)
    finally:
        close((p, d0, d1))


def test_open_send_survives_other_peers_and_expires():
    (p, d0, d1), _ = trio()
    try:
        hs = p.send(None, "late", [3], lease_timeout=0.5)
        d1.close()  # a peer that never posted leaving does not fail an open send
        with pytest.raises(kvxfer.errors.TransferTimeout):
            hs.wait(T)
        assert p.held_blocks() == {}
    finally:
        close((p, d0, d1))


def test_open_send_cancelled_by_its_receiver():
    (p, d0, d1), _ = trio()
    try:
        hr = d0.recv("c", [4], timeout=0.5)
        with pytest.raises(kvxfer.errors.TransferTimeout):
            hr.wait(T)
        for _ in range(2000):  # D's CANCEL reaches P asynchronously
            if not p.pending_recvs():
                break
            threading.Event().wait(0.005)
        hs = p.send(None, "c", [3])  # the post was withdrawn: nobody matches it
        assert not hs.done() and p.pending_recvs() == []
        hs.cancel()
        assert p.held_blocks() == {}
    finally:
        close((p, d0, d1))
