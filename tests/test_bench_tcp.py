"""The TCP benchmark's pieces: a --listen/--connect pair over UCX TCP (with NIXL's
remote target when NIXL is installed) and the per-repetition summary of
benchmarks/tcp_netns.sh."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two adjacent free ports")


def _listening(port: int) -> bool:
    """A socket listens on ``port`` (read from /proc: a probe connection would be the
    listener's one accepted session)."""
    with open("/proc/net/tcp") as f:
        next(f)
        return any(line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A" for line in f)


def _wait_listening(port: int, proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"listener exited: {proc.communicate()[0]}")
        if _listening(port):
            return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def test_listen_connect_over_ucx_tcp_with_remote_nixl(tmp_path):
    from kvxfer.bench.nixl import available

    nixl = available() is not None
    port = _free_port_pair()
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONPATH": str(ROOT),
           "KVXFER_BENCH_SECRET": "test-bench-secret-0123"}
    compare = ["--compare", "nixl", "--rounds", "2"] if nixl else []
    cli = [sys.executable, "-m", "kvxfer.cli", "bench", "transfer"]
    listener = subprocess.Popen([*cli, "--listen", f"127.0.0.1:{port}", "--timeout", "60", *compare], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(port, listener)
        if nixl:
            _wait_listening(port + 1, listener)
        out = tmp_path / "t.json"
        run = subprocess.run([*cli, "--connect", f"127.0.0.1:{port}", "--backend", "ucx", "--no-progress",
                              "--start-block-size", "4K", "--max-block-size", "128K", "--batch-size", "16",
                              "--iters", "4", "--warmup", "1", "--check", "--json", str(out), *compare],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        listener.wait(60)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait(10)
    rows = json.loads(out.read_text())["rows"]
    assert [r["block_size"] for r in rows] == [4096 << i for i in range(6)]
    for r in rows:
        assert r["transport"] == "ucx:tcp+am-rma" and r["gbps"] > 0
        if nixl:
            assert r["nixl_gbps"] > 0 and r["ratio_vs_nixl"] > 0


def _summary_module():
    spec = importlib.util.spec_from_file_location("tcp_summary", ROOT / "benchmarks" / "tcp_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tcp_summary_ratios_per_repetition_and_medians(tmp_path):
    def iperf(k, gbps):
        doc = {"end": {"sum_received": {"bits_per_second": gbps * 8e9}}}
        (tmp_path / f"iperf3-{k}.json").write_text(json.dumps(doc))

    def rows(tag, rep, kvx, nixl):
        row = {"block_size": 4096, "block": "4 KiB", "batch": 2048, "transport": "ucx:tcp+am-rma",
               "gbps": kvx, "nixl_gbps": nixl}
        (tmp_path / f"kvxfer-{tag}-{rep}.json").write_text(json.dumps({"rows": [row]}))

    for k, g in ((1, 1.0), (2, 3.0), (3, 1.0), (4, 2.0)):  # limits per rep: 2.0, 2.0, 1.5
        iperf(k, g)
    for rep, (kvx, nx) in enumerate(((1.0, 0.5), (2.0, 1.0), (0.3, 0.3)), start=1):
        rows("small", rep, kvx, nx)
    (tmp_path / "load.txt").write_text("rep1 1.0 1.0 1.0\nend 2.0 2.0 2.0\n")
    mod = _summary_module()
    s = mod.summarize(str(tmp_path))
    (row,) = s["rows"]
    assert row["x_iperf3"] == pytest.approx([0.5, 1.0, 0.2])
    assert row["median_x_iperf3"] == pytest.approx(0.5)
    assert row["x_nixl"] == pytest.approx([2.0, 2.0, 1.0]) and row["median_x_nixl"] == pytest.approx(2.0)
    assert row["median_limit_gbps"] == pytest.approx(2.0)
    text = mod.render(s)
    assert "| 4 KiB x 2048 |" in text and "**0.50**" in text and "rep1 1.0 1.0 1.0" in text


def test_tcp_summary_uses_iperf3_with_as_many_streams_as_kvxfer_lanes(tmp_path):
    def iperf(name, gbps):
        doc = {"end": {"sum_received": {"bits_per_second": gbps * 8e9}}}
        (tmp_path / name).write_text(json.dumps(doc))

    for k in (1, 2):
        iperf(f"iperf3-{k}.json", 2.0)   # one stream
        iperf(f"iperf3p4-{k}.json", 3.0)  # four streams: the limit kvxfer's 4 lanes are held to
    row = {"block_size": 65536, "block": "64 KiB", "batch": 64, "transport": "ucx:tcp+am-rma", "gbps": 3.3}
    (tmp_path / "kvxfer-large-1.json").write_text(json.dumps({"rows": [row]}))
    mod = _summary_module()
    s = mod.summarize(str(tmp_path))
    (r,) = s["rows"]
    assert s["streams"] == 4 and s["iperf3_pn_gbps"] == [3.0, 3.0]
    assert r["x_iperf3"] == pytest.approx([1.1]) and r["x_iperf3_p1"] == pytest.approx([1.65])
    text = mod.render(s)
    assert "iperf3 -P 4" in text and "**1.10**" in text
    iperf("iperf3p2-1.json", 2.5)  # mixed stream counts in one directory: refused
    with pytest.raises(ValueError, match="stream counts"):
        mod.summarize(str(tmp_path))
