"""Where an agent's pack/unpack run, and how their completion is ordered.

The agent never launches device work or waits on it itself; it asks its
:class:`Device`. Every operation returns a *token* that completes when its
bytes are in place, and the agent waits on that token before anything reads
what the operation wrote (a network post of a packed staging slice; the free
of an unpacked slice, the ACK and the recv completion)::

    token = dev.capture(after)          # send(..., after=): the producer's event, taken at call time
    dev.query(token) -> bool            # complete? (None is)
    dev.wait(token, timeout)            # host wait; TransferTimeout when it runs out
    token = dev.pack(layout, ids, layers, heads, out, after=(tokens))   # queued behind `after`
    token = dev.unpack(layout, buf, ids, layers, heads)
    token = dev.copy_blocks(src, src_ids, dst, dst_ids, layers, heads, after=(tokens))  # pool to pool

* :class:`HostDevice` (CPU pools): copies run before the call returns; tokens
  are None. A producer token makes no sense for host memory (``after`` must be None).
* :class:`CudaDevice`: one stream per agent on the pool's device; every launch
  runs under ``torch.cuda.device(pool device)`` on that stream, which first
  waits (``wait_event``, on the GPU) for the ``after`` events; the token is a
  ``torch.cuda.Event`` recorded right after the launch. ``after`` may be a
  ``torch.cuda.Event`` or a ``torch.cuda.Stream`` (an event is recorded on it
  when ``send`` is called, so later work on that stream is not waited for).

``ipc``: what maps a same-node peer's pool into this process
(:mod:`kvxfer.transport.cuda_peer`); None: the agent uses the CUDA driver's for a
CUDA pool, and no peer copies for a host pool. Tests plug in a host stand-in.

Tests plug in a deferred device (``tests/deferred_device.py``) whose
operations run later on a worker thread, so a missing wait shows up as wrong bytes.
"""
from __future__ import annotations

import time

from ..errors import TransferTimeout


class Device:
    """The interface; see the module doc."""

    ipc = None

    def capture(self, after):
        if after is not None:
            raise TypeError(f"after= needs a CUDA pool (a torch.cuda.Event or Stream); got {type(after).__name__}")
        return None

    def query(self, token) -> bool:
        return True

    def wait(self, token, timeout: float) -> None:
        """Return once ``token`` (None, a token, or a sequence of them) completed."""
        tokens = token if isinstance(token, (list, tuple)) else (token,)
        deadline = time.monotonic() + timeout
        delay = 20e-6
        for t in tokens:
            while t is not None and not self.query(t):
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"device work not complete after {timeout:.3g} s")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def pack(self, layout, ids, layers, heads, out, after=()):
        raise NotImplementedError

    def unpack(self, layout, buf, ids, layers, heads):
        raise NotImplementedError

    def copy_blocks(self, src, src_ids, dst, dst_ids, layers, heads, after=()):
        """Blocks ``src_ids`` of pool ``src`` into ``dst_ids`` of ``dst`` in one launch
        (:func:`kvxfer.kernels.copy_blocks`), behind ``after``."""
        raise NotImplementedError

    def close(self) -> None:
        """Wait for everything this device launched (before its buffers go away)."""


class HostDevice(Device):
    """CPU pools: the native copy returns with every byte in place (tokens are None).
    ``copy_backend``: the backend of :meth:`copy_blocks` (None: the default, native)."""

    copy_backend = None

    def pack(self, layout, ids, layers, heads, out, after=()):
        from . import pack

        self.wait(tuple(after), 0.0)
        pack(layout, ids, layers=layers, heads=heads, out=out)
        return None

    def unpack(self, layout, buf, ids, layers, heads):
        from . import unpack

        unpack(layout, buf, ids, layers=layers, heads=heads)
        return None

    def copy_blocks(self, src, src_ids, dst, dst_ids, layers, heads, after=()):
        from . import copy_blocks

        self.wait(tuple(after), 0.0)
        copy_blocks(src, src_ids, dst, dst_ids, layers=layers, heads=heads, backend=self.copy_backend)
        return None


class CudaDevice(Device):
    """A CUDA pool: kvxfer's own stream on the pool's device, an event per operation."""

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)

    def capture(self, after):
        import torch

        if after is None or isinstance(after, torch.cuda.Event):
            return after
        if isinstance(after, torch.cuda.Stream):
            with torch.cuda.device(after.device):
                event = torch.cuda.Event()
                event.record(after)
            return event
        raise TypeError(f"after must be a torch.cuda.Event, a torch.cuda.Stream or None, got {type(after).__name__}")

    def query(self, token) -> bool:
        return token is None or token.query()

    def _launch(self, fn, after):
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for event in after:
                if event is not None:
                    self.stream.wait_event(event)
            fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def pack(self, layout, ids, layers, heads, out, after=()):
        from . import pack

        return self._launch(lambda: pack(layout, ids, layers=layers, heads=heads, out=out), after)

    def unpack(self, layout, buf, ids, layers, heads):
        from . import unpack

        return self._launch(lambda: unpack(layout, buf, ids, layers=layers, heads=heads), ())

    def copy_blocks(self, src, src_ids, dst, dst_ids, layers, heads, after=()):
        from . import copy_blocks

        return self._launch(lambda: copy_blocks(src, src_ids, dst, dst_ids, layers=layers, heads=heads), after)

    def close(self) -> None:
        self.stream.synchronize()


def device_for(layout) -> Device:
    """The device an agent uses for ``layout``'s pool."""
    return CudaDevice(layout.device) if layout.device.type == "cuda" else HostDevice()
