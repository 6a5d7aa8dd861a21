"""kvxfer bench: statistics, limits, the transfer CLI on tiny sizes (loopback backend,
and the spawned-process UCX/vm backends where they are built), --json schema,
--check catching a corrupted byte, --compare nixl (skipped without NIXL).
Timing is never asserted."""
from __future__ import annotations

import json
import math

import pytest

from kvxfer.bench import envinfo, limits
from kvxfer.bench.stats import gbps, percentile, summarize
from kvxfer.cli import main

TINY = ["--start-block-size", "4K", "--max-block-size", "8K", "--batch-size", "4",
        "--iters", "3", "--warmup", "1", "--no-progress"]


def test_stats_median_p99_and_empty():
    s = summarize([5, 1, 3, 2, 4])
    assert (s.median, s.min, s.max, s.mean, s.count) == (3, 1, 5, 3, 5)
    assert percentile(range(101), 99) == pytest.approx(99)
    assert percentile([1, 2], 50) == pytest.approx(1.5)
    assert math.isnan(summarize([]).median)
    assert gbps(2e9, 1.0) == 2.0
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_limits_return_steady_state_samples():
    assert len(limits.memcpy_seconds(4096, 3, warmup=1)) == 3
    with limits.SocketLimit(timeout=20) as sock:
        samples = sock.seconds(1 << 16, 3, warmup=1)
    assert len(samples) == 3 and all(s > 0 for s in samples)


def test_envinfo_busy_threshold(monkeypatch):
    monkeypatch.setattr(envinfo, "load_average", lambda: (100.0, 0.0, 0.0))
    assert "busy" in envinfo.busy_warning()
    monkeypatch.setattr(envinfo, "load_average", lambda: (0.0, 0.0, 0.0))
    assert envinfo.busy_warning() is None
    info = envinfo.collect(transport="x")
    assert info["transport"] == "x" and info["num_cores"] >= 1 and "ucx_tls" in info


@pytest.mark.parametrize("op,path", [("write", "zero-copy"), ("read", "pack"), ("write", "auto")])
def test_transfer_loopback_json_schema(tmp_path, op, path):
    out = tmp_path / "t.json"
    png = tmp_path / "t.png"
    assert main(["bench", "transfer", "--backend", "loopback", "--op", op, "--path", path, "--check",
                 "--json", str(out), "--plot", str(png), *TINY]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "transfer" and doc["schema"] == 1
    env = doc["environment"]
    for key in ("cpu_model", "num_cores", "ucx_version", "ucx_tls", "transport", "git_commit", "load_average"):
        assert key in env
    assert [r["block_size"] for r in doc["rows"]] == [4096, 8192]
    for row in doc["rows"]:
        assert row["transport"] == "loopback" and row["path"] in ("zero-copy", "pack")
        assert len(row["samples"]["kvxfer"]["latency_s"]) == 3      # warm-up excluded
        assert len(row["samples"]["memcpy_s"]) == 3
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0 and row["ratio_to_limit"] > 0
        assert row["gbps_min"] <= row["gbps"] <= row["gbps_max"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_check_catches_a_corrupted_byte(monkeypatch, capsys):
    monkeypatch.setenv("KVXFER_BENCH_CORRUPT_BYTE", "4097")
    rc = main(["bench", "transfer", "--backend", "loopback", "--check", *TINY])
    assert rc == 1
    assert "byte 4097 differs" in capsys.readouterr().err
    monkeypatch.delenv("KVXFER_BENCH_CORRUPT_BYTE")  # without the check the hook is inert
    assert main(["bench", "transfer", "--backend", "loopback", *TINY]) == 0


def _native_backend_available() -> bool:
    try:
        from kvxfer.transport import make_backend

        make_backend("auto").close()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _native_backend_available(), reason="kvxfer UCX/vm backend not built")
def test_transfer_spawned_processes_check(tmp_path, monkeypatch):
    out = tmp_path / "t.json"
    assert main(["bench", "transfer", "--backend", "auto", "--check", "--json", str(out), *TINY]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["transport"] not in ("", "?")
    monkeypatch.setenv("KVXFER_BENCH_CORRUPT_BYTE", "0")  # inherited by the spawned target
    assert main(["bench", "transfer", "--backend", "auto", "--check", *TINY]) == 1


def test_compare_nixl_without_nixl_exits_nonzero(monkeypatch, capsys):
    import kvxfer.bench.nixl as nixl

    monkeypatch.setattr(nixl, "available", lambda: None)
    assert main(["bench", "transfer", "--backend", "loopback", "--compare", "nixl", *TINY]) == 2
    assert "NIXL is not importable" in capsys.readouterr().err


def test_compare_nixl(tmp_path):
    import kvxfer.bench.nixl as nixl

    if nixl.available() is None:
        pytest.skip("NIXL (nixl-cu12) not installed")
    out = tmp_path / "n.json"
    assert main(["bench", "transfer", "--backend", "loopback", "--compare", "nixl", "--rounds", "2",
                 "--json", str(out), *TINY[:-5], "--iters", "4", "--warmup", "1", "--no-progress"]) == 0
    for row in json.loads(out.read_text())["rows"]:
        assert row["nixl_gbps"] > 0 and row["ratio_vs_nixl"] > 0
        assert len(row["samples"]["nixl"]["latency_s"]) == 4  # two rounds of two


def test_parse_size_and_bad_sweep():
    from kvxfer.bench.transfer import parse_size

    assert parse_size("4K") == 4096 and parse_size("1MiB") == 1 << 20 and parse_size("512") == 512
    with pytest.raises(ValueError):
        parse_size("0")
    with pytest.raises(ValueError):
        main(["bench", "transfer", "--backend", "loopback", "--start-block-size", "8K",
              "--max-block-size", "4K"])
