"""A target agent that never calls into kvxfer still serves UCX.

UCX accepts connections, reaps closed ones and serves RMA emulated over TCP only
while the target progresses. The agent's I/O thread sleeps on the UCX worker's
event fd, so an idle agent does all of that by itself.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import Agent

from agent_procs import SECRET, make_pool
from idle_target import TCP, T, ask as _ask, idle_agent


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("backend", ["ucx", "auto"])  # auto: the vm path carries the bytes
def test_connect_close_cycles_do_not_leak_target_fds(backend, monkeypatch):
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)
    layout = make_pool("2 N B H D", 1)
    with idle_agent(backend) as (proc, _, address):
        with Agent("p", secret=SECRET, backend=backend) as p:
            p.register_kv(layout)
            p.disconnect(p.connect(address))  # UCX's first connection opens its listener
        base = _num_fds(proc.pid)
        with Agent("p", secret=SECRET, backend=backend) as p:
            p.register_kv(layout)
            for _ in range(30):
                p.disconnect(p.connect(address))
        for _ in range(10):
            with Agent("p", secret=SECRET, backend=backend) as p:
                p.register_kv(layout)
                p.connect(address)
        # Closed sockets are reaped at the target's next progress: let it notice.
        deadline = time.monotonic() + T
        while _num_fds(proc.pid) > base + 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _num_fds(proc.pid) <= base + 8, (base, _num_fds(proc.pid))


def test_one_sided_write_into_an_idle_agent_over_tcp_completes(monkeypatch):
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)
    layout = make_pool("2 N B H D", 3)
    local, remote = [4, 9, 1, 30], [7, 0, 22, 5]
    with idle_agent("ucx") as (_, pipe, address):
        with Agent("p", secret=SECRET, backend="ucx") as p:
            p.register_kv(layout)
            peer = p.connect(address)
            assert peer.transport.startswith("ucx:tcp")
            h = p.write(peer, local, remote, notify=b"landed")
            h.wait(T)  # no timing assertion: it must complete at all
            assert p.held_blocks() == {}
            got = np.frombuffer(_ask(pipe, "pack", remote), np.uint8)
            want = kvxfer.pack(layout, local, backend="reference").numpy().reshape(-1).view(np.uint8)
            assert np.array_equal(got, want)
            deadline = time.monotonic() + T
            while b"landed" not in _ask(pipe, "notes") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert b"landed" in _ask(pipe, "notes")

