"""`kvxfer bench e2e` runs end to end on a tiny shape and verifies every request's bytes:
a byte corrupted (by the test) in one middle request fails the run."""
from __future__ import annotations

import json

import pytest

from kvxfer.cli import main

TINY = ["--model", "custom", "--layers", "2", "--heads", "2", "--head-dim", "16", "--tokens", "64",
        "--block-size", "4"]


def test_bench_e2e_tiny(tmp_path):
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", *TINY, "--layout", "nhd:hnd", "--tp", "1:2",
               "--iters", "2", "--warmup", "1", "--rtt-iters", "5", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["bitwise_ok"] and res["verified_requests"] == 3 + 5
    assert res["bytes"] == 2 * 2 * 16 * 64 * 2 * 2  # layers, kv, head dim, tokens, heads, bf16
    assert len(res["seconds"]) == 2 and len(res["memcpy_seconds"]) == 2
    assert res["rtt_p50_us"] > 0 and res["ratio_to_memcpy"] > 0 and res["memcpy_resources"]["threads"] >= 1
    assert res["environment"]["load_average_at_start"]


def _corrupt_after(monkeypatch, bad_request: str) -> None:
    """Make D's handle of ``bad_request`` flip one bit of the first destination block after
    the real transfer completed: a transport that delivered one wrong byte, once."""
    import torch

    from kvxfer.agent import Agent

    layouts = {}
    real_register, real_recv = Agent.register_kv, Agent.recv

    def register_kv(self, layout):
        layouts[id(self)] = layout
        return real_register(self, layout)

    class Corrupting:
        def __init__(self, handle, layout, block):
            self._handle, self._layout, self._block = handle, layout, block

        def wait(self, *args, **kwargs):
            self._handle.wait(*args, **kwargs)
            words = self._layout.kv_view(1, 1)[self._block].view(torch.int16)
            words[0, 0, 0] ^= 1

        def __getattr__(self, name):
            return getattr(self._handle, name)

    def recv(self, request_id, block_ids, *args, **kwargs):
        handle = real_recv(self, request_id, block_ids, *args, **kwargs)
        if request_id == bad_request:
            return Corrupting(handle, layouts[id(self)], list(block_ids)[0])
        return handle

    monkeypatch.setattr(Agent, "register_kv", register_kv)
    monkeypatch.setattr(Agent, "recv", recv)


@pytest.mark.parametrize("bad_request", ["req-2", "rtt-1"])
def test_bench_e2e_fails_on_a_wrong_byte_in_any_request(monkeypatch, capsys, bad_request):
    # req-2 is the second of three timed requests: later requests rewrite the block, so a
    # check of the last request alone would pass; the per-request check must not.
    _corrupt_after(monkeypatch, bad_request)
    rc = main(["bench", "e2e", *TINY, "--iters", "3", "--warmup", "1", "--rtt-iters", "3"])
    assert rc == 1
    assert f"request {bad_request}: decode rank 0" in capsys.readouterr().err


def test_bench_e2e_compare_nixl(tmp_path):
    from kvxfer.bench import nixl

    if nixl.available() is None:
        pytest.skip("NIXL is not installed (make bench-compare installs it)")
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", *TINY, "--iters", "2", "--warmup", "1", "--rtt-iters", "0",
               "--compare", "nixl", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["bitwise_ok"] and len(res["nixl_seconds"]) == 2 and res["ratio_to_nixl"] > 0
    assert res["nixl_threads"] == res["memcpy_resources"]["threads"]
