"""Tensor parallelism in the connector without engines: which heads each rank holds,
which P ranks a D rank loads from, the refusal of unmappable pairs, and a P rank's
:class:`Outbound` serving every D rank that needs its heads (a recording agent stands
in for kvxfer's; the real agents meet in tests/test_vllm_tp_pd.py)."""
from __future__ import annotations

import pytest

from kvxfer.errors import LayoutMismatch
from kvxfer.integrations.vllm.meta import SendSpec
from kvxfer.integrations.vllm.outbound import Outbound
from kvxfer.integrations.vllm.tp import (RankInfo, agent_name, check_pair, covers, heads_of_peer, overlapping,
                                         parse_ranks, rank_heads, rank_listen, ranks_param, whole)


def test_rank_heads_and_names():
    assert [rank_heads(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert rank_heads(3, 0, 1) == (0, 3)
    with pytest.raises(LayoutMismatch, match="3 kv heads do not split evenly over tensor_parallel_size=2"):
        rank_heads(3, 0, 2)
    with pytest.raises(LayoutMismatch, match="replicates"):
        rank_heads(2, 3, 4)  # vLLM would give each of 4 ranks one of 2 heads
    assert heads_of_peer(agent_name("consumer", "e1", 1, 2), 4) == (2, 4)
    assert heads_of_peer("some-other-agent", 4) == (0, 4)
    assert rank_listen("0.0.0.0:7000", 1) == "0.0.0.0:7001" and rank_listen("127.0.0.1:0", 1) == "127.0.0.1:0"


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_each_d_rank_loads_exactly_its_heads(p_tp, d_tp):
    p = tuple(RankInfo(f"p{r}:1", *rank_heads(4, r, p_tp)) for r in range(p_tp))
    params = {"remote_ranks": ranks_param(p), "remote_kv_heads": 4}
    ranks, heads = parse_ranks(params)
    check_pair(ranks, heads, 4)
    for d in range(d_tp):
        lo, hi = rank_heads(4, d, d_tp)
        chosen = overlapping(ranks, lo, hi)
        assert covers([(r.lo, r.hi) for r in chosen], lo, hi)
        assert all(r.lo < hi and lo < r.hi for r in chosen)  # none without a common head


def test_unmappable_pairs_are_refused_by_name():
    p = (RankInfo("a:1", 0, 2), RankInfo("b:1", 2, 4))
    with pytest.raises(LayoutMismatch, match="prefill engine has 4, this decode engine 3"):
        check_pair(p, 4, 3)
    with pytest.raises(LayoutMismatch, match=r"not each of the 4 heads once"):
        check_pair((RankInfo("a:1", 0, 2), RankInfo("b:1", 0, 2)), 4, 4)  # replicated heads
    with pytest.raises(ValueError, match="malformed"):
        parse_ranks({"remote_ranks": [["a:1", 0]], "remote_kv_heads": 4})
    ranks, heads = parse_ranks({"remote_addr": "a:1"})  # a TP 1 P of an older connector
    assert whole(ranks, 3) == (RankInfo("a:1", 0, 3),) and heads == 0


class FakeHandle:
    def __init__(self, kind, peer=None):
        self.kind, self.peer, self.state, self.nbytes = kind, peer, "pending", 64
        self.created = self.finished = 1.0

    def done(self):
        return self.state != "pending"

    def cancel(self):
        if self.state == "pending":
            self.state = "cancelled"


class Peer:
    def __init__(self, name):
        self.name = name


class RecordingAgent:
    """Records send / send_layer calls; each stream (peer, request) has one handle."""

    def __init__(self):
        self.calls, self.handles = [], {}

    def send(self, peer, req, ids, *, lease_timeout=None):
        self.calls.append(("send", getattr(peer, "name", None), req))
        h = self.handles[(getattr(peer, "name", None), req, len(self.calls))] = FakeHandle("send")
        return h

    def send_layer(self, peer, req, layer, ids):
        self.calls.append(("layer", getattr(peer, "name", None), req, layer))
        key = (getattr(peer, "name", None), req)
        return self.handles.setdefault(key, FakeHandle("stream"))


def test_a_p_rank_serves_both_d_ranks_of_a_tp2_decode():
    """P TP 1 (heads 0-3) -> D TP 2: the catch-all goes to whichever D rank asks first;
    the other D rank's waiting recv gets its own send; settled once both ended done and
    both leases were released."""
    agent = RecordingAgent()
    ob = Outbound(SendSpec("r", (1, 2), "w"), (0, 4), 4, 30.0)
    ob.start(agent)
    assert agent.calls == [("send", None, "w")]
    catch_all = ob.active[None]
    catch_all.peer, catch_all.state = agent_name("consumer", "d", 1, 2), "done"
    ob.poll(agent, [Peer(agent_name("consumer", "d", 0, 2))])
    assert agent.calls[-1] == ("send", agent_name("consumer", "d", 0, 2), "w")
    assert ob.covered == [(2, 4)] and not ob.settled()
    ob.active[agent_name("consumer", "d", 0, 2)].state = "done"
    ob.active[agent_name("consumer", "d", 0, 2)].peer = agent_name("consumer", "d", 0, 2)
    ob.poll(agent, [])
    assert covers(ob.covered, 0, 4) and not ob.settled()  # leases still held
    ob.leases = 0  # both on_release callbacks arrived
    assert ob.settled() and len(agent.calls) == 2


def test_a_stream_ships_each_layer_and_a_late_d_rank_gets_the_whole_request():
    agent = RecordingAgent()
    ob = Outbound(SendSpec("r", (1,), "w", streaming=True), (0, 2), 4, 30.0)
    for layer in range(3):
        ob.add_layer(agent, layer)
    assert agent.calls == [("layer", None, "w", 0), ("layer", None, "w", 1), ("layer", None, "w", 2)]
    ob.finish_layers()
    stream = ob.active[None]
    stream.peer, stream.state = agent_name("consumer", "d", 0, 4), "done"  # D TP 4: heads 0-1 of ours
    ob.poll(agent, [Peer(agent_name("consumer", "d", 1, 4))])
    assert agent.calls[-1] == ("send", agent_name("consumer", "d", 1, 4), "w")


def test_a_failed_d_rank_settles_the_request_without_new_sends():
    agent = RecordingAgent()
    ob = Outbound(SendSpec("r", (1,), "w"), (0, 4), 4, 30.0)
    ob.start(agent)
    ob.active[None].state = "failed"
    ob.leases = 0
    ob.poll(agent, [Peer("x-tp0of2")])
    assert ob.settled() and ob.failed and len(agent.calls) == 1


def test_a_catch_all_is_armed_again_until_the_heads_are_covered():
    agent = RecordingAgent()
    ob = Outbound(SendSpec("r", (1,), "w"), (0, 4), 4, 30.0)
    ob.start(agent)
    ob.active[None].peer, ob.active[None].state = agent_name("consumer", "d", 0, 2), "done"
    ob.poll(agent, [])  # D rank 1's recv has not arrived yet
    assert agent.calls == [("send", None, "w"), ("send", None, "w")]
    ob.cancel()
    assert ob.active[None].state == "cancelled"
    ob.leases = 0
    ob.poll(agent, [])
    assert ob.settled()
