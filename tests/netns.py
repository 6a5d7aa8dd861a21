"""Network namespaces as hosts, for tests that need more than one machine.

``with Hosts(2) as (a, b):`` gives two "hosts": network namespaces joined by a
veth pair (``10.77.0.1/24`` and ``10.77.0.2/24``); ``Hosts(n)`` for n > 2 joins
them through a bridge in a hub namespace of their own. ``host.popen(argv)``
runs a process there in its own pid, ipc, uts and mount namespaces
(``ip netns exec NS unshare --uts --pid --ipc --mount-proc --fork
--kill-child``): it sees its own hostname, pid 1, /proc and no other network
than that namespace's. Killing the returned process (the ``unshare``) kills
everything inside (``--kill-child``, then the pid namespace goes away).

Everything created is removed on exit, also on failure: processes are killed,
then the namespaces deleted (which deletes their veth ends). Names carry this
process's pid, so concurrent test runs do not collide; addresses live only
inside the namespaces, so the host's routes are never touched. Traffic stays in
namespaces the test created (and their loopback).

:func:`unavailable` says why namespaces cannot be used here (not root, no
``ip``/``unshare``, the kernel refuses), or None.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time

SUBNET = "10.77.0"
_counter = itertools.count()
_probe: list = []  # cached answer of unavailable()


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=timeout)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    if _probe:
        return _probe[0]
    reason = None
    if os.geteuid() != 0:
        reason = "network namespaces need root (CI runs as root)"
    elif shutil.which("ip") is None:
        reason = "no `ip` command (install iproute2; `make test` does as root)"
    elif shutil.which("unshare") is None:
        reason = "no `unshare` command (util-linux)"
    else:
        name = f"kvxprobe{os.getpid()}"
        try:
            _ip("netns", "add", name)
            out = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "--pid", "--ipc",
                                  "--mount-proc", "--fork", "true"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode != 0:
                reason = f"unshare inside a namespace failed: {out.stderr.strip()}"
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            reason = f"cannot create a network namespace: {str(detail).strip()}"
        finally:
            _ip("netns", "del", name, check=False)
    _probe.append(reason)
    return reason


class Host:
    """One namespace "host": ``ns`` (its name), ``ip`` (its address), ``ifname``."""

    def __init__(self, ns: str, ip: str, ifname: str):
        self.ns, self.ip, self.ifname = ns, ip, ifname
        self.procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host({self.ns}, {self.ip})"

    def popen(self, argv: list[str], *, env: dict | None = None, hostname: str | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` in this host's namespaces (its own pid/ipc/uts/mount too)."""
        inner = list(argv)
        if hostname:
            inner = ["sh", "-c", 'hostname "$0" && exec "$@"', hostname, *inner]
        cmd = ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--pid", "--ipc",
               "--mount-proc", "--fork", "--kill-child", *inner]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 30, env: dict | None = None) -> str:
        """Run a short command in this network namespace only; its stdout
        (``subprocess.CalledProcessError``, with ``stderr``, if it fails)."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], check=True, capture_output=True,
                              text=True, timeout=timeout, env=env).stdout

    def listening(self) -> list[tuple[str, int]]:
        """(address, port) of every listening TCP socket in this namespace (``ss -ltn``)."""
        out = []
        for line in self.run(["ss", "-ltnH"]).splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            addr, _, port = fields[3].rpartition(":")
            out.append((addr.strip("[]"), int(port)))
        return out

    def kill_all(self) -> None:
        for proc in self.procs:
            stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 10) -> int | None:
    """SIGKILL ``proc`` and its session (bounded wait); its exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


class Hosts:
    """``n`` namespace hosts on ``SUBNET.0/24`` (see the module docstring)."""

    def __init__(self, n: int, subnet: str = SUBNET):
        if n < 2:
            raise ValueError("Hosts needs n >= 2")
        self.n, self.subnet = n, subnet
        self.tag = f"kvx{os.getpid() % 100000}{next(_counter)}"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []

    def __enter__(self) -> list[Host]:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self.hosts

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> str:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _create(self) -> None:
        t = self.tag
        names = [self._netns(f"{t}h{i}") for i in range(self.n)]
        if self.n == 2:
            _ip("link", "add", f"{t}v0", "netns", names[0], "type", "veth",
                "peer", "name", f"{t}v1", "netns", names[1])
        else:
            hub = self._netns(f"{t}hub")
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "link", "set", "br0", "up")
            for i, ns in enumerate(names):
                _ip("link", "add", f"{t}v{i}", "netns", ns, "type", "veth",
                    "peer", "name", f"{t}p{i}", "netns", hub)
                _ip("-n", hub, "link", "set", f"{t}p{i}", "master", "br0")
                _ip("-n", hub, "link", "set", f"{t}p{i}", "up")
        for i, ns in enumerate(names):
            ifname, ip = f"{t}v{i}", f"{self.subnet}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            self.hosts.append(Host(ns, ip, ifname))
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 20) -> None:
        """Until every host's link is up (veth/bridge links come up asynchronously)."""
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            while "LOWER_UP" not in _ip("-n", host.ns, "-o", "link", "show", "dev", host.ifname).stdout:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the link of {host} did not come up")
                time.sleep(0.1)

    def close(self) -> None:
        for host in self.hosts:
            host.kill_all()
        for ns in reversed(self._namespaces):
            _ip("netns", "del", ns, check=False)
        self._namespaces.clear()
