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
