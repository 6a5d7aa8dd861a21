"""kvxfer bench: statistics, limits (native copy on the path's threads, native TCP loop),
the transfer CLI on tiny sizes (loopback backend, and the spawned-process UCX/vm
backends where they are built), --json schema, --check catching a byte corrupted by
a faulty backend the test injects, --compare nixl (skipped without NIXL).
Timing is never asserted."""
from __future__ import annotations

import json
import math

import pytest

from kvxfer.bench import copy_limit, resources, tcp_limit
from kvxfer.report import envinfo
from kvxfer.report.stats import gbps, percentile, summarize
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


@pytest.mark.parametrize("nbytes,threads,streaming", [(4096, 1, False), (5 << 20, 2, False),
                                                      (5 << 20, 2, True), (1000, 2, True)])
def test_memcpy_limit_copies_every_byte(nbytes, threads, streaming):
    limit = copy_limit.MemcpyLimit(nbytes, threads=threads, streaming=streaming)
    assert limit.check()  # the timed copy is not a no-op, whatever the split
    samples = limit.seconds(3, warmup=1)
    assert len(samples) == 3 and all(s > 0 for s in samples)
    with pytest.raises(ValueError):
        copy_limit.MemcpyLimit(0)


def test_cold_memcpy_limit_flushes_a_buffer_past_the_last_level_cache():
    llc = copy_limit.last_level_cache_bytes()
    assert llc > 0
    limit = copy_limit.MemcpyLimit(5 << 20, streaming=True, cold=True)
    assert min(max(4 * llc, 256 << 20), 2 << 30) == limit.flusher.nbytes
    assert limit.check()
    before = limit.flusher._buf[::64].copy()
    assert len(limit.seconds(2, warmup=0)) == 2
    assert (limit.flusher._buf[::64] == before).all()  # the flush reads, it leaves no dirty lines
    assert copy_limit.MemcpyLimit(5 << 20).flusher is None
    assert copy_limit.MemcpyLimit(1 << 20, cold=True).flusher is limit.flusher  # one buffer a process


def test_tcp_limit_is_native_and_returns_steady_state_samples():
    with tcp_limit.SocketLimit(timeout=30) as sock:
        samples = sock.seconds(1 << 16, 3, warmup=1)
        assert len(samples) == 3 and all(s > 0 for s in samples)
        with pytest.raises(ValueError):
            sock.seconds(0, 3)
    assert tcp_limit.build().read_bytes()[:4] == b"\x7fELF"


def test_tcp_limit_without_compiler_raises(monkeypatch, tmp_path):
    from kvxfer.errors import KVXferError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KVXferError, match="native TCP limit"):
        tcp_limit.build()


def test_vm_resources_follow_the_environment(monkeypatch):
    monkeypatch.delenv("KVXFER_VM_THREADS", raising=False)
    monkeypatch.delenv("KVXFER_VM_SPLIT_BYTES", raising=False)
    monkeypatch.setattr(resources, "num_cores", lambda: 8)
    assert resources.for_path("vm", 64 << 20).threads == 2       # csrc default: min(cores, 2)
    assert resources.for_path("vm", 1 << 20).threads == 1        # below the 4 MiB split
    assert resources.for_path("ucx:cma", 64 << 20).threads == 1
    assert resources.for_path("vm", 64 << 20, senders=2).threads == 4
    monkeypatch.setenv("KVXFER_VM_THREADS", "9")
    assert resources.for_path("vm", 64 << 20).threads == 4       # capped as in csrc
    monkeypatch.setenv("KVXFER_VM_SPLIT_BYTES", "0")
    assert resources.for_path("vm", 64 << 20).threads == 1       # 0: never split
    assert resources.for_path("vm", 64 << 20, path="pack").streaming
    assert resources.for_path("vm", 64 << 20, shared=True).streaming      # memcpy into a mapped pool
    assert not resources.for_path("vm", 16 << 20, shared=True).streaming  # below STREAM_BYTES
    assert not resources.for_path("ucx:cma", 64 << 20, shared=True).streaming


def test_vm_resources_read_the_settings_as_the_agents_do(monkeypatch):
    # the measured agents take KVXFER_VM_* through AgentConfig.from_env and the C++ rule;
    # so does the limit's thread count: a value an agent refuses is refused here too
    from kvxfer import _native

    monkeypatch.delenv("KVXFER_VM_SPLIT_BYTES", raising=False)
    monkeypatch.setattr(resources, "num_cores", lambda: 3)
    monkeypatch.setenv("KVXFER_VM_THREADS", "3")
    assert resources.vm_threads() == _native.load().vm_resolve_threads(3, 3) == 3
    from kvxfer.transport import vm_copy_threads

    assert vm_copy_threads(None, 8) == 2 and vm_copy_threads(9, 8) == 4 and vm_copy_threads(None, 1) == 1
    for bad in ("many", "0"):
        monkeypatch.setenv("KVXFER_VM_THREADS", bad)
        with pytest.raises(ValueError, match="KVXFER_VM_THREADS|copy_threads"):
            resources.for_path("vm", 64 << 20)


def test_envinfo_busy_threshold(monkeypatch):
    monkeypatch.setattr(envinfo, "load_average", lambda: (100.0, 0.0, 0.0))
    assert "busy" in envinfo.busy_warning()
    monkeypatch.setattr(envinfo, "load_average", lambda: (0.0, 0.0, 0.0))
    assert envinfo.busy_warning() is None
    info = envinfo.collect(transport="x")
    assert info["transport"] == "x" and info["num_cores"] >= 1 and "ucx_tls" in info


@pytest.mark.parametrize("op,path", [("write", "zero-copy"), ("read", "pack"), ("write", "pack")])
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
        assert len(row["samples"]["memcpy_s"]) == 3 and row["memcpy_threads"] == 1
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0 and row["ratio_to_limit"] > 0
        assert row["gbps_min"] <= row["gbps"] <= row["gbps_max"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def _faulty_loopback(bad_post: int):
    """A loopback backend whose ``bad_post``-th post (counted over all instances) flips
    the first byte it wrote: a transport that lands one wrong byte in one iteration."""
    import ctypes

    from kvxfer.transport.loopback import LoopbackBackend

    posts = []

    class Faulty(LoopbackBackend):
        def post(self, conn, op, descs):
            req = super().post(conn, op, descs)
            posts.append(op)
            if len(posts) == bad_post:
                import numpy as np

                d = np.asarray(descs, dtype=np.int64).reshape(-1, 5)[0]
                peer = conn.remote_regions
                addr = (peer._regions[int(d[2])][0] + int(d[3]) if op == "write"
                        else self._regions[int(d[0])][0] + int(d[1]))
                ctypes.c_uint8.from_address(int(addr)).value ^= 0xFF
            return req

    return Faulty


@pytest.mark.parametrize("path", ["zero-copy", "pack"])
def test_check_catches_a_byte_corrupted_in_a_middle_iteration(monkeypatch, capsys, path):
    import kvxfer.transport as transport

    faulty = _faulty_loopback(bad_post=3)  # warm-up 1, then measured iteration 1 (of 3), first row
    monkeypatch.setattr(transport, "make_backend", lambda name, **kw: faulty())
    rc = main(["bench", "transfer", "--backend", "loopback", "--path", path, "--check", *TINY])
    assert rc == 1
    assert "iteration 2: byte 0 differs" in capsys.readouterr().err
    # the same fault without --check goes unnoticed: the check is what catches it
    monkeypatch.setattr(transport, "make_backend", lambda name, **kw: _faulty_loopback(3)())
    assert main(["bench", "transfer", "--backend", "loopback", "--path", path, *TINY]) == 0


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
    assert rows[0]["socket_gbps"] > 0 and rows[0]["memcpy_threads"] >= 1


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


def test_copy_constants_come_from_the_extension():
    """Python's copy sizes are csrc's (vm_copy.h, copy.h): one source for each number."""
    from kvxfer import _native
    from kvxfer.kernels import STREAM_BYTES

    C = _native.load()
    assert STREAM_BYTES == C.STREAM_BYTES
    from kvxfer.config import MAX_TCP_LANES

    assert MAX_TCP_LANES == C.MAX_TCP_LANES
    from kvxfer.transport import vm_copy_limits

    assert vm_copy_limits() == {"default_threads": C.VM_DEFAULT_THREADS, "max_threads": C.VM_MAX_THREADS,
                                "split_bytes": C.VM_SPLIT_BYTES} == {"default_threads": 2, "max_threads": 4,
                                                                     "split_bytes": 4 << 20}
