"""Polling with a deadline for tests: one helper instead of a copy per test file."""
from __future__ import annotations

import time


def until(predicate, what: str = "condition", timeout: float = 120.0, interval: float = 0.1):
    """Call ``predicate`` every ``interval`` s until it returns a truthy value; return that value.

    Raises ``AssertionError`` naming ``what`` when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f}s")
        time.sleep(interval)


def until_closed(s, deadline: float) -> bytes:
    """What the server sent on socket ``s`` before it closed it; closes ``s``.

    Raises ``AssertionError`` when ``s`` is still open at ``deadline`` (monotonic)."""
    import socket

    got = b""
    try:
        while True:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                data = s.recv(4096)
            except socket.timeout:
                raise AssertionError(f"still open at the deadline: {got[:80]!r}") from None
            except ConnectionResetError:
                return got
            if not data:
                return got
            got += data
    finally:
        s.close()


def within(predicate, timeout: float, interval: float = 0.5) -> bool:
    """Whether ``predicate()`` turns truthy within ``timeout`` seconds (polled every
    ``interval`` s, once more at the end): for ``assert within(...), why``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
