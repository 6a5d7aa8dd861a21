"""AgentConfig: frozen and validated, environment only through from_env, and its
fields reach the agent's parts (staging size, path, per-peer limits, timeouts)."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import kvxfer
from kvxfer import Agent, AgentConfig, CostModel
from kvxfer.config import PeerLimits

from agent_procs import SECRET, make_pool

T = 20.0


def test_defaults_frozen_and_exported():
    cfg = AgentConfig()
    assert kvxfer.AgentConfig is AgentConfig
    assert (cfg.staging_bytes, cfg.path, cfg.lease_timeout, cfg.hugepages) == (32 << 20, "auto", 30.0, "advise")
    assert cfg.limits == PeerLimits() and cfg.cost_model is None
    assert kvxfer.CostModel is kvxfer.transport.CostModel
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.path = "pack"
    assert cfg.replace(path="pack").path == "pack" and cfg.path == "auto"


@pytest.mark.parametrize("bad", [dict(path="fast"), dict(staging_bytes=0), dict(staging_bytes=1.5),
                                 dict(hugepages="always"), dict(copy_threads=0), dict(vm_split_bytes=-1),
                                 dict(lease_timeout=0), dict(handshake_timeout=float("nan")),
                                 dict(ucx={"UCX_TLS": "tcp"}), dict(ucx={"": "x"}), dict(tcp_lanes=0),
                                 dict(tcp_lanes=17), dict(tcp_lanes=2.0), dict(tcp_lanes=True)])
def test_bad_fields_raise_value_error(bad):
    with pytest.raises(ValueError):
        AgentConfig(**bad)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError):
        AgentConfig(limits={"max_notes": 1})
    with pytest.raises(TypeError):
        AgentConfig(ucx=5)
    with pytest.raises(ValueError):
        PeerLimits(max_notes=0)
    with pytest.raises(TypeError):
        Agent("x", secret=SECRET, backend="loopback", config={"path": "pack"})


def test_from_env_applies_only_the_documented_overrides():
    env = {"KVXFER_HUGEPAGES": "off", "KVXFER_VM_THREADS": "3", "KVXFER_VM_SPLIT_BYTES": "0",
           "KVXFER_STAGING_BYTES": "8192", "KVXFER_PATH": "pack", "KVXFER_TCP_LANES": "2",
           "KVXFER_OTHER": "ignored"}
    cfg = AgentConfig.from_env(env, lease_timeout=5.0)
    assert (cfg.hugepages, cfg.copy_threads, cfg.vm_split_bytes, cfg.staging_bytes, cfg.path,
            cfg.lease_timeout, cfg.tcp_lanes) == ("off", 3, 0, 8192, "pack", 5.0, 2)
    assert AgentConfig.from_env({}) == AgentConfig()
    assert AgentConfig().tcp_lanes == AgentConfig.from_env({}).tcp_lanes == 1  # striping is opt-in
    with pytest.raises(ValueError, match="KVXFER_VM_THREADS"):
        AgentConfig.from_env({"KVXFER_VM_THREADS": "many"})
    with pytest.raises(ValueError):
        AgentConfig.from_env({"KVXFER_HUGEPAGES": "sometimes"})
    with pytest.raises(ValueError, match="KVXFER_TCP_LANES"):
        AgentConfig.from_env({"KVXFER_TCP_LANES": "two"})
    with pytest.raises(ValueError, match="tcp_lanes"):
        AgentConfig.from_env({"KVXFER_TCP_LANES": "0"})


def test_ucx_settings_accept_a_dict_or_pairs():
    assert AgentConfig(ucx={"TLS": "tcp"}).ucx_settings() == {"TLS": "tcp"}
    assert AgentConfig(ucx=(("TLS", "tcp"), ("TCP_TX_SEG_SIZE", "64k"))).ucx_settings() == {
        "TLS": "tcp", "TCP_TX_SEG_SIZE": "64k"}


def test_agent_uses_its_config():
    cfg = AgentConfig(staging_bytes=2 << 20, path="pack", lease_timeout=7.0)
    with Agent("c", secret=SECRET, backend="loopback", config=cfg) as a:
        assert a.config is cfg and a.leases.default_ttl_s == 7.0
        a.register_kv(make_pool("2 N B H D", None))
        assert a._state.pool.stage_in_t.numel() == 2 << 20


@pytest.mark.parametrize("kwarg,value", [("lease_timeout", 7.0), ("staging_bytes", 2 << 20), ("path", "pack"),
                                         ("cost_model", CostModel())])
def test_agent_takes_settings_only_through_its_config(kwarg, value):
    """The config is the one configuration surface: the former keyword overrides are gone."""
    with pytest.raises(TypeError, match=kwarg):
        Agent("c", secret=SECRET, backend="loopback", **{kwarg: value})
    AgentConfig(**{kwarg: value})  # where each of them lives now


def test_cost_model_is_a_validated_config_field():
    cm = CostModel(per_desc_us=1e6)  # every piece goes pack
    with pytest.raises(TypeError):
        AgentConfig(cost_model="pack")
    for bad in (dict(pack_gbps=0), dict(per_desc_us=-1.0), dict(stage_rtt_us=float("inf"))):
        with pytest.raises(ValueError):
            CostModel(**bad)
    with pytest.raises(TypeError):
        CostModel(per_desc_us=True)
    p = Agent("p", secret=SECRET, backend="loopback", config=AgentConfig(cost_model=cm))
    d = Agent("d", secret=SECRET, backend="loopback")
    try:
        p.register_kv(make_pool("2 N B H D", 1))
        d.register_kv(make_pool("2 N B H D", None))
        peer = p.connect(d.address)
        hr = d.recv("r", [3, 4], timeout=20.0)
        hs = p.send(peer, "r", [1, 2])
        hs.wait(20.0)
        hr.wait(20.0)
        assert hs.path == "pack" and p._state.cost is cm  # same layouts go zero-copy by default
    finally:
        p.close()
        d.close()


def test_config_path_and_limits_reach_the_transfer():
    limits = PeerLimits(max_notify_bytes=64, max_notes=2)
    p = Agent("p", secret=SECRET, backend="loopback", config=AgentConfig(path="pack", limits=limits))
    d = Agent("d", secret=SECRET, backend="loopback", config=AgentConfig(limits=limits))
    try:
        p.register_kv(make_pool("2 N B H D", 1))
        d.register_kv(make_pool("2 N B H D", None))
        peer = p.connect(d.address)
        hr = d.recv("r", [3, 4], timeout=T)
        hs = p.send(peer, "r", [1, 2])
        hs.wait(T)
        hr.wait(T)
        assert hs.path == "pack"  # forced by the config, not the cost model
        assert torch.equal(kvxfer.pack(p._state.layout, [1, 2], backend="reference"),
                           kvxfer.pack(d._state.layout, [3, 4], backend="reference"))
        with pytest.raises(ValueError, match="64 B"):
            p.write(peer, [1], [1], notify=b"x" * 65)
        for _ in range(2):
            p.write(peer, [1], [1], notify=b"n").wait(T)
        # a third undrained notification is over D's configured limit: D closes this peer
        p.write(peer, [1], [1], notify=b"n")
        for _ in range(2000):
            if not peer.is_connected:
                break
            threading.Event().wait(0.01)
        assert not peer.is_connected
        assert [data for _, data in d.notifications()] == [b"n", b"n"]
    finally:
        p.close()
        d.close()


def test_ucx_settings_and_hugepages_reach_the_native_engine():
    """AgentConfig.ucx is applied with ucp_config_modify: a setting UCX does not know is a
    typed error at construction, a known one is accepted (nothing read from KVXFER_*)."""
    from kvxfer.errors import KVXferError
    from kvxfer.transport import make_backend

    with pytest.raises(KVXferError, match="NO_SUCH_KVXFER_SETTING"):
        make_backend("ucx", config=AgentConfig(ucx={"NO_SUCH_KVXFER_SETTING": "1"}))
    make_backend("ucx", config=AgentConfig(ucx={"TCP_TX_SEG_SIZE": "32k"}, hugepages="off")).close()


def test_tcp_lanes_reach_the_native_engine_which_checks_them_too():
    from kvxfer._native import load
    from kvxfer.transport import make_backend

    b = make_backend("ucx", config=AgentConfig(tcp_lanes=3))
    try:
        assert b.num_endpoints == 0
    finally:
        b.close()
    for bad in (0, 17):  # the engine refuses what AgentConfig would have refused
        with pytest.raises(ValueError, match="tcp_lanes"):
            load().Engine(False, {}, "off", bad)


def test_an_agent_without_config_uses_the_defaults_not_the_environment(monkeypatch):
    monkeypatch.setenv("KVXFER_PATH", "pack")
    monkeypatch.setenv("KVXFER_STAGING_BYTES", "8192")
    with Agent("x", secret=SECRET, backend="loopback") as a:
        assert a.config == AgentConfig()
    with Agent("x", secret=SECRET, backend="loopback", config=AgentConfig.from_env()) as a:
        assert (a.config.path, a.config.staging_bytes) == ("pack", 8192)


def test_from_env_explicit_fields_beat_the_environment():
    env = {"KVXFER_PATH": "pack", "KVXFER_STAGING_BYTES": "8192"}
    cfg = AgentConfig.from_env(env, path="zero_copy")
    assert (cfg.path, cfg.staging_bytes) == ("zero_copy", 8192)


def test_only_entry_points_read_the_environment():
    # config.py's promise: below the entry points (CLI, bench, the serving workers, the vLLM
    # connector) nothing reads the environment but the process-wide knobs it names
    import pathlib

    root = pathlib.Path(kvxfer.__file__).parent
    entry = ("cli/", "bench/", "serving/", "integrations/")
    named = {"config.py", "secrets.py", "_native.py", "kernels/__init__.py", "report/envinfo.py"}
    readers = {str(p.relative_to(root)) for p in root.rglob("*.py")
               if "os.environ" in p.read_text() or "getenv" in p.read_text()}
    assert {r for r in readers if not r.startswith(entry)} <= named, readers
    # and the secret loader is called from entry points only
    callers = {str(p.relative_to(root)) for p in root.rglob("*.py")
               if "load_secret(" in p.read_text() and p.name != "secrets.py"}
    assert callers and all(c.startswith(entry) for c in callers), callers


@pytest.mark.parametrize("tls,uses", [(None, True), ("", True), ("all", True), ("tcp", False), ("tcp,self", False),
                                      ("sm,tcp", True), ("shm", True), ("posix,tcp", True), ("rc,cma", False),
                                      ("^tcp", True), ("^sm", False), ("^posix,sysv,xpmem", False),
                                      ("^posix", True)])
def test_ucx_tls_decides_whether_kvxfer_sets_mm_error_handling(tls, uses):
    from kvxfer._native import uses_shared_memory

    assert uses_shared_memory(tls) is uses


def test_a_store_node_on_tcp_only_prints_its_address_first():
    """With UCX_TLS=tcp kvxfer leaves UCX_MM_ERROR_HANDLING unset, so UCX has no unused
    variable to warn about on stdout ahead of the node's first line (which scripts read)."""
    import os
    import selectors
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("UCX_MM_ERROR_HANDLING", "UCX_WARN_UNUSED_ENV_VARS")}
    env.update(UCX_TLS="tcp", KVXFER_SECRET=SECRET.decode())
    proc = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "store", "--listen", "127.0.0.1:0", "--capacity",
                             "4M", "--slot-size", "64K", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline, first = time.monotonic() + 120, ""
        while not first and time.monotonic() < deadline and proc.poll() is None:
            if sel.select(1.0):
                first = proc.stdout.readline()
        assert first.startswith("kvxfer store listening on 127.0.0.1:"), first
    finally:
        proc.terminate()
        proc.wait(timeout=30)
