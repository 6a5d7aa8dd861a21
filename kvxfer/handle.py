"""``TransferHandle``: the caller's view of one asynchronous transfer.

States (:class:`HandleState`): ``PENDING`` -> ``DONE`` | ``FAILED`` | ``CANCELLED``
(final, set once). A state compares equal to its lower-case name (``h.state == "done"``).
``done`` promises what the operation promised: for ``send``/``recv``/``write``,
the bytes are visible in the destination blocks (flushed, and for the pack path
unpacked); for ``read``, the bytes are in the local blocks. A handle that
streams layers also records each layer as it lands, so ``wait(layer=l)`` can
return before the whole request has arrived. :meth:`TransferHandle.add_done_callback`
runs a function once the handle is final (for engines that poll nothing).

The agent side never writes a handle's fields (it reads public ones, as a caller
does: ``state``, ``done()``, ``kind``, ``request_id``, ``path``, ``nbytes``): it creates
a :class:`HandleCompleter`, gives the caller ``completer.handle`` and changes it only
through the completer's small interface (``succeed``, ``fail``, ``mark_layers``,
``expect_layers``, ``set_canceller`` for what ``cancel()`` does, and
``set_path``/``set_peer``/``add_bytes`` for what the caller reads while it runs).
"""
from __future__ import annotations

import enum
import logging
import threading
import time

from .errors import KVXferError, TransferCancelled, TransferTimeout
from .timeouts import check_timeout

log = logging.getLogger("kvxfer")


class HandleState(str, enum.Enum):
    """State of a :class:`TransferHandle`; equal to its value (``HandleState.DONE == "done"``)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


PENDING, DONE, FAILED, CANCELLED = HandleState


class TransferHandle:
    """Returned by :meth:`Agent.send`, :meth:`~Agent.recv`, :meth:`~Agent.write`, :meth:`~Agent.read`.

    Use as a context manager to cancel on early exit::

        with agent.recv("req-1", block_ids, timeout=10.0) as h:
            h.wait(timeout=10.0)
    """

    def __init__(self, kind: str, request_id: str, peer: str | None, *, layers=(), on_cancel=None) -> None:
        self.kind = kind
        self.request_id = request_id
        self.peer = peer
        self.path: str | None = None  # "zero_copy" | "pack" once chosen
        self.nbytes = 0
        self.created = time.monotonic()
        self.finished: float | None = None
        self._layers = frozenset(layers)
        self._layers_done: set[int] = set()
        self._state = PENDING
        self._error: BaseException | None = None
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._layer_waiters = 0  # wait(layer=) calls blocked now; a landed layer wakes only them
        self._callbacks: list = []

    # ---- caller API -------------------------------------------------------------
    @property
    def state(self) -> HandleState:
        return self._state

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def layers_done(self) -> frozenset:
        with self._cond:
            return frozenset(self._layers_done)

    def done(self) -> bool:
        """True once final (done, failed or cancelled); never blocks."""
        return self._state != PENDING

    def wait(self, timeout: float | None = None, *, layer: int | None = None) -> None:
        """Block until complete (or until ``layer`` landed); raise the transfer's error.

        :class:`TransferTimeout` if ``timeout`` passes first (the transfer itself
        goes on; cancel it if you give up), :class:`TransferCancelled` if
        cancelled, the typed failure (``PeerDisconnected``, ...) if it failed.
        ``timeout``: seconds, finite and > 0 (ValueError otherwise), or None: no limit
        (every handle becomes final, at the latest when its agent closes).
        """
        timeout = check_timeout(timeout)
        if layer is not None and self._layers and layer not in self._layers:
            raise ValueError(f"layer {layer} is not part of this transfer")

        def ready() -> bool:
            return self._state != PENDING or (layer is not None and layer in self._layers_done)

        with self._cond:
            if layer is not None:
                self._layer_waiters += 1
            try:
                ok = self._cond.wait_for(ready, timeout)
            finally:
                if layer is not None:
                    self._layer_waiters -= 1
            if not ok:
                raise TransferTimeout(f"{self!r} still pending after {timeout} s")
            if layer is not None and layer in self._layers_done:
                return
            state, error = self._state, self._error
        if state == CANCELLED:
            raise TransferCancelled(f"{self.kind} {self.request_id!r} was cancelled")
        if state == FAILED:
            raise error
        return

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` once, when the handle reaches a final state (now, in this
        thread, if it already has). It runs on the agent thread that finished the
        transfer, possibly with the agent's lock held: keep it short, never wait on the
        agent from it. An exception it raises is logged (logger ``kvxfer``) with its
        traceback; the transfer and other callbacks are unaffected."""
        if not callable(fn):
            raise TypeError(f"add_done_callback needs a callable, got {type(fn).__name__}")
        with self._cond:
            if self._state == PENDING:
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def _run_callback(self, fn) -> None:
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - a caller's bug must not break the agent thread
            log.exception("done callback %r of %r raised", fn, self)

    def _run_callbacks(self, callbacks: list) -> None:
        for fn in callbacks:
            self._run_callback(fn)

    def cancel(self) -> bool:
        """Cancel if still pending (frees its leases, tells the peer); True if it did."""
        on_cancel = self._on_cancel  # _finish drops it
        if not self._finish(CANCELLED, None):
            return False
        if on_cancel is not None:
            on_cancel(self)
        return True

    def __enter__(self) -> "TransferHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def __repr__(self) -> str:
        extra = f" path={self.path}" if self.path else ""
        if self._layers:
            extra += f" layers={len(self._layers_done)}/{len(self._layers)}"
        if self._error is not None:
            extra += f" error={type(self._error).__name__}"
        return (f"<TransferHandle {self.kind} {self.request_id!r} peer={self.peer} "
                f"{self._state.value} {self.nbytes} B{extra}>")

    # ---- agent side -------------------------------------------------------------
    def _finish(self, state: HandleState, error: BaseException | None) -> bool:
        with self._cond:
            if self._state != PENDING:
                return False
            self._state, self._error = state, error
            self.finished = time.monotonic()
            self._on_cancel = None  # it refers back to the agent's op: let both go now
            # taken with the state, in one hold of the lock: a second acquisition would
            # race the woken waiter for it (a lock convoy on every completion)
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        self._run_callbacks(callbacks)
        return True

    def _succeed(self) -> bool:
        with self._cond:
            if self._state != PENDING:
                return False
            self._layers_done |= self._layers
            self._state = DONE
            self.finished = time.monotonic()
            self._on_cancel = None
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        self._run_callbacks(callbacks)
        return True

    def _fail(self, error: KVXferError) -> bool:
        return self._finish(FAILED, error)

    def _mark_layers(self, layers) -> None:
        if not layers:
            return
        with self._cond:
            self._layers_done.update(layers)
            if self._layer_waiters:  # a whole-transfer wait would only wake to sleep again
                self._cond.notify_all()


class HandleCompleter:
    """The agent's side of one :class:`TransferHandle` (internal interface).

    Created with the handle's arguments; ``handle`` goes to the caller, the completer
    stays with the agent, which moves the handle to a final state only through it.
    ``succeed``/``fail`` return False if the handle was already final (set once).
    """

    __slots__ = ("handle",)

    def __init__(self, kind: str, request_id: str, peer: str | None, *, layers=(), on_cancel=None) -> None:
        self.handle = TransferHandle(kind, request_id, peer, layers=layers, on_cancel=on_cancel)

    def set_canceller(self, fn) -> None:
        """``fn(handle)`` runs once if the caller cancels a still pending handle."""
        self.handle._on_cancel = fn

    def succeed(self) -> bool:
        """Final DONE: every promised layer landed (wakes waiters, runs callbacks)."""
        return self.handle._succeed()

    def fail(self, error: KVXferError) -> bool:
        """Final FAILED with ``error`` (raised by ``wait``)."""
        return self.handle._fail(error)

    def set_path(self, path: str, *, keep: bool = False) -> None:
        """``handle.path`` is ``path`` (``keep``: only if none is set yet)."""
        if not keep or self.handle.path is None:
            self.handle.path = path

    def set_peer(self, name: str) -> None:
        """``handle.peer`` is ``name`` unless the handle names its peer already."""
        if self.handle.peer is None:
            self.handle.peer = name

    def add_bytes(self, nbytes: int) -> None:
        """``nbytes`` more bytes moved (``handle.nbytes``)."""
        self.handle.nbytes += nbytes

    def mark_layers(self, layers) -> None:
        """These layers landed (``wait(layer=l)`` returns for them)."""
        self.handle._mark_layers(layers)

    def expect_layers(self, layers) -> None:
        """The layers this handle promises, once known (a streaming send learns them at match)."""
        self.handle._layers = frozenset(layers)
