"""Two "hosts" on one machine: P and D agents in separate net/pid/ipc/uts namespaces.

The namespaces are joined by a veth pair (tests/netns.py); UCX may use TCP only
(``UCX_TLS=tcp``), so the bytes cross the veth link as they would cross a
network. The received blocks must equal the sent ones bit for bit, and neither
namespace may have a listening socket on anything but its own given address.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import netns
import two_host_agent as side

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WAIT_S = 180.0


@pytest.fixture
def hosts():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Hosts(2) as pair:
        yield pair


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["UCX_TLS"] = "tcp"
    return env


def _wait_for(path: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args[-3:]} exited with {proc.returncode} before {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S:.0f}s")
        time.sleep(0.1)


def test_kv_crosses_two_namespace_hosts_bitwise_over_ucx_tcp(hosts, tmp_path):
    import torch

    a, b = hosts
    script = os.path.join(HERE, "two_host_agent.py")
    out = str(tmp_path)
    d = b.popen([sys.executable, script, "d", f"{b.ip}:47000", out], env=_env(), hostname="host-d")
    _wait_for(os.path.join(out, "d.ready"), [d])
    d_address = open(os.path.join(out, "d.ready")).read()
    assert d_address == f"{b.ip}:47000"
    p = a.popen([sys.executable, script, "p", f"{a.ip}:0", out, d_address], env=_env(),
                hostname="host-p")
    _wait_for(os.path.join(out, "p.json"), [p, d])
    _wait_for(os.path.join(out, "d.pt"), [p, d])

    # both agents are up: nothing listens beyond each host's given address
    for host in (a, b):
        listening = host.listening()
        assert listening and {addr for addr, _ in listening} == {host.ip}, (host, listening)
    assert (b.ip, 47000) in b.listening()

    open(os.path.join(out, "quit"), "w").close()
    assert p.wait(timeout=60) == 0 and d.wait(timeout=60) == 0

    report = json.loads(open(os.path.join(out, "p.json")).read())
    assert report["transport"].startswith("ucx:tcp"), report
    assert report["hostname"] == "host-p" and report["pid"] == 1  # its own uts and pid namespaces
    sent, got = side.make_pool(seeded=True), torch.load(os.path.join(out, "d.pt"))
    assert torch.equal(got[side.DST_BLOCKS], sent[side.SRC_BLOCKS])
    untouched = [i for i in range(got.shape[0]) if i not in side.DST_BLOCKS]
    assert not got[untouched].any()
