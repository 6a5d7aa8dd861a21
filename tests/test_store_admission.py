"""A store node admits connections as an agent's listener does (``kvxfer.auth.HandshakeGate``):
a flood of sockets that never speak -- reconnecting, from the legitimate clients' own
address -- leaves their handshakes succeeding; and at its open-file limit the node stops
accepting instead of spinning on its backlog (real node processes, real sockets)."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import torch

import kvxfer
from kvxfer.errors import KVXferError
from kvxfer.net import open_authenticated
from kvxfer.store.node import CLIENT_INFO
from floods import silent_flood
from store_cases import SECRET, block_bits, make_layout, start_node, stop_node

T = 20.0


def _legit_round_trip(address: str, src, dst, i: int) -> bool:
    keys = kvxfer.block_keys(range(4 * 2), 4, salt=f"legit-{i}".encode())
    try:
        with kvxfer.KVStore(nodes=[address], secret=SECRET, timeout=T) as st:
            put = st.put(keys, src, [0, 1])
            put.wait(timeout=T)
            if put.result.stored != 2:
                return False
            st.get(keys, dst, [2, 3]).wait(timeout=T)
    except KVXferError:
        return False
    return all(torch.equal(block_bits(src, b), block_bits(dst, b + 2)) for b in (0, 1))


def test_a_reconnecting_silent_flood_from_the_clients_address_does_not_lock_them_out():
    """80 sockets from 127.0.0.1 that never send their HELLO, reopened 4 times a second
    (more than the old node's 64 pending handshakes, which then refused every new
    connection): >= 9 of 10 legitimate clients on the same address put and get bitwise."""
    proc, address = start_node()
    stop = threading.Event()
    try:
        src = make_layout("2 N B H D", 4, seed=11)
        _, count = silent_flood(address, stop)
        while count[0] < 200:  # the flood is on
            time.sleep(0.05)
        ok = 0
        for i in range(10):
            dst = make_layout("2 N B H D", 4)
            ok += _legit_round_trip(address, src, dst, i)
        assert ok >= 9, f"{ok}/10 legitimate clients got through"
        assert proc.poll() is None
    finally:
        stop.set()
        stop_node(proc)


def _authenticated(address: str, out: list) -> None:
    """One client connection that completes the handshake and then holds its socket."""
    info = {"name": "holder", "agent_id": "holder", "layout": {"kind": CLIENT_INFO}, "backend": b"", "staging": 0}
    try:
        sock, _ = open_authenticated(address, SECRET, info, lambda fields: None, 3.0)
        out.append(sock)
    except (KVXferError, OSError):
        pass


def test_at_its_open_file_limit_the_node_pauses_accepting_without_spinning(tmp_path):
    """A node whose hard open-file limit is 96 keeps at most 32 clients (64 files kept
    back). 60 clients that authenticate and stay, 40 more connections in its backlog:
    the node pauses accepting and says so at most once a second (the old one, which kept
    accepting into its open-file limit, spun on the backlog it could not take and logged
    each failed accept); once they close, a client gets through. (CPU use at the limit:
    a benchmark's matter, not this test's.)"""
    log = open(tmp_path / "node.log", "w+")
    proc, address = start_node(wrap=lambda cmd: ["prlimit", "--nofile=96:96", "--", *cmd], stderr=log)
    held: list = []
    socks = []
    try:
        threads = [threading.Thread(target=_authenticated, args=(address, held)) for _ in range(60)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        host, port = address.rsplit(":", 1)
        for _ in range(40):
            s = socket.create_connection((host, int(port)), timeout=2.0)  # into the kernel's backlog
            socks.append(s)
        assert 1 <= len(held) <= 60
        time.sleep(3.5)  # at its limit with a backlog: a node that retried accept() would log each try
        log.flush()
        lines = [ln for ln in open(tmp_path / "node.log") if "accept" in ln]
        assert 1 <= len(lines) <= 8 and all("not accepting for now" in ln for ln in lines), (len(lines), lines[:3])
        for s in held + socks:
            s.close()
        held, socks = [], []
        src = make_layout("2 N B H D", 4, seed=12)
        dst = make_layout("2 N B H D", 4)
        deadline = time.monotonic() + 30
        while not _legit_round_trip(address, src, dst, 99):
            assert time.monotonic() < deadline, "no client got through after the others closed"
            time.sleep(0.5)
        assert proc.poll() is None
    finally:
        for s in held + socks:
            s.close()
        stop_node(proc)
        log.close()


def test_raise_fd_limit_takes_the_soft_limit_to_the_hard_one():
    out = subprocess.run(["prlimit", "--nofile=200:4096", "--", "python3", "-c",
                          "import resource,sys; sys.path.insert(0, '.');"
                          "from kvxfer.net import raise_fd_limit; print(raise_fd_limit(), "
                          "resource.getrlimit(resource.RLIMIT_NOFILE)[0])"],
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(kvxfer.__file__)))
    assert out.stdout.split() == ["4096", "4096"], out.stderr
