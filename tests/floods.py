"""A flood of connections that never speak, for the listeners' admission tests."""
from __future__ import annotations

import socket
import threading


def silent_flood(address: str, stop: threading.Event, *, width: int = 80, source: str = "127.0.0.1",
                 period: float = 0.25) -> tuple[threading.Thread, list]:
    """``width`` sockets from ``source`` to ``address`` ("host:port") that connect and never
    speak, each reopened every ``period`` s until ``stop``; the thread, and a list whose one
    item counts the connects so far."""
    host, port = address.rsplit(":", 1)
    count = [0]

    def run():
        socks = []
        while not stop.is_set():
            for s in socks:
                s.close()
            socks = []
            for _ in range(width):
                s = socket.socket()
                try:
                    s.bind((source, 0))
                    s.settimeout(2.0)
                    s.connect((host, int(port)))
                    socks.append(s)
                    count[0] += 1
                except OSError:
                    s.close()
            stop.wait(period)
        for s in socks:
            s.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, count
