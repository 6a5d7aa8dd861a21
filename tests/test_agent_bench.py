"""`kvxfer bench e2e` runs end to end on a tiny shape and verifies its bytes."""
from __future__ import annotations

import json

from kvxfer.cli import main


def test_bench_e2e_tiny(tmp_path):
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--model", "custom", "--layers", "2", "--heads", "2", "--head-dim", "16",
               "--tokens", "64", "--block-size", "4", "--layout", "nhd:hnd", "--tp", "1:2",
               "--iters", "2", "--warmup", "1", "--rtt-iters", "5", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["bitwise_ok"]
    assert res["bytes"] == 2 * 2 * 16 * 64 * 2 * 2  # layers, kv, head dim, tokens, heads, bf16
    assert len(res["seconds"]) == 2 and res["rtt_p50_us"] > 0 and res["ratio_to_memcpy"] > 0


def test_bench_e2e_compare_nixl(tmp_path):
    import pytest

    from kvxfer.bench import nixl

    if nixl.available() is None:
        pytest.skip("NIXL is not installed (make bench-compare installs it)")
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--model", "custom", "--layers", "2", "--heads", "2", "--head-dim", "16",
               "--tokens", "64", "--block-size", "4", "--iters", "2", "--warmup", "1", "--rtt-iters", "0",
               "--compare", "nixl", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["bitwise_ok"] and len(res["nixl_seconds"]) == 2 and res["ratio_to_nixl"] > 0
