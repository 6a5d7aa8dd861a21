"""A deferred-execution device for tests: kvxfer's stream semantics, on CPU.

:class:`DeferredStream` is a worker thread that runs submitted jobs in order,
each after an injected ``delay`` (a stream: FIFO, asynchronous to the caller);
every job completes a :class:`DeferredEvent`. :class:`DeferredDevice`
implements :class:`kvxfer.kernels.device.Device` on one such stream: ``pack``
and ``unpack`` return at once and copy later, after first waiting (on the
worker, like ``cudaStreamWaitEvent``) for the ``after`` events. So an agent
that posts, frees, acknowledges or completes before waiting for an event sees
stale bytes, which the ordering tests detect bitwise. A test's "engine" writes
its pool through its own :class:`DeferredStream` and passes the event as ``after=``.
"""
from __future__ import annotations

import queue
import threading
import time

from kvxfer.kernels.device import Device

JOB_TIMEOUT_S = 30.0


class DeferredEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def _set(self) -> None:
        self._done.set()


class DeferredStream:
    """Runs ``submit``ted jobs in order on one thread, each ``delay`` seconds after it reaches the head."""

    def __init__(self, delay: float, name: str = "deferred") -> None:
        self.delay = delay
        self.errors: list = []
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, after=()) -> DeferredEvent:
        event = DeferredEvent()
        self._q.put((fn, tuple(after), event))
        return event

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, after, event = item
            try:
                for e in after:
                    if e is not None and not e.wait(JOB_TIMEOUT_S):
                        raise TimeoutError("an after= event never completed")
                time.sleep(self.delay)
                fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced by the test through .errors
                self.errors.append(exc)
            event._set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(JOB_TIMEOUT_S)


class DeferredDevice(Device):
    """Pack/unpack and pool-to-pool copies run later on a worker thread (host pools, the
    native copy). With ``ipc`` (tests/host_ipc.py) the pool is offered to same-node peers."""

    def __init__(self, delay: float = 0.05) -> None:
        self.stream = DeferredStream(delay, "deferred-device")
        self.launched = 0

    def capture(self, after):
        if after is not None and not isinstance(after, DeferredEvent):
            raise TypeError(f"after must be a DeferredEvent, got {type(after).__name__}")
        return after

    def query(self, token) -> bool:
        return token is None or token.query()

    def pack(self, layout, ids, layers, heads, out, after=()):
        from kvxfer.kernels import pack

        self.launched += 1
        return self.stream.submit(lambda: pack(layout, ids, layers=layers, heads=heads, out=out), after)

    def unpack(self, layout, buf, ids, layers, heads):
        from kvxfer.kernels import unpack

        self.launched += 1
        return self.stream.submit(lambda: unpack(layout, buf, ids, layers=layers, heads=heads))

    def copy_blocks(self, src, src_ids, dst, dst_ids, layers, heads, after=()):
        from kvxfer.kernels import copy_blocks

        self.launched += 1
        return self.stream.submit(lambda: copy_blocks(src, src_ids, dst, dst_ids, layers=layers, heads=heads), after)

    def close(self) -> None:
        self.wait(self.stream.submit(lambda: None), JOB_TIMEOUT_S)
        self.stream.close()
