"""Modelled devices shared by simulated workers: K devices, processor sharing.

By default each simulated worker models an accelerator of its own: its step
sleeps the profile's time whatever the other workers do. ``kvxfer serve
--engine sim --sim-devices K`` instead gives the server's simulated workers K
devices to share, as the operating system shares K cores among single-threaded
workers pinned to one CPU group (or as MPS shares a GPU): while ``B`` workers
are in a step, each step advances at ``min(1, K / B)`` of its modelled speed.
A step alone on its device takes the profile's time; three steps at once on
two devices take 1.5 times as long each. The profile then is the step time of
one worker with a device to itself (fit it to steps logged where each worker
had its own core, ``kvxfer profile --from-steps``).

The busy state is one byte per worker in a small file that every worker maps
(``/dev/shm`` where present): a worker sets its byte while in a step and
clears it after; each writes only its own byte. A step re-reads the count
every :data:`QUANTUM_S` (the sharing's time resolution). A worker killed in a
step leaves its byte set until it restarts in the same slot, which clears it.
"""
from __future__ import annotations

import mmap
import os
import secrets
import tempfile
import time

QUANTUM_S = 0.001  # how often a step re-reads how many workers share the devices


def _dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create_device_file(num_slots: int) -> str:
    """A new zeroed busy file of ``num_slots`` slots (one per worker); returns its path.
    The creator unlinks it when the workers are gone."""
    if type(num_slots) is not int or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    path = os.path.join(_dir(), f"kvxfer-sim-devices-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, bytes(num_slots))
    finally:
        os.close(fd)
    return path


class SharedDevices:
    """One worker's view of the K shared devices: slot ``slot`` of the file at ``path``."""

    def __init__(self, path: str, slot: int, num_devices: int) -> None:
        if type(num_devices) is not int or num_devices < 1:
            raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if type(slot) is not int or not 0 <= slot < size:
                raise ValueError(f"slot must be an int in [0, {size}), got {slot!r}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.slot, self.num_devices = path, slot, num_devices
        self._mm[slot] = 0  # a restarted worker's slot: not busy

    def busy(self) -> int:
        """How many workers are in a step now (this one included if it is)."""
        return len(self._mm) - self._mm[:].count(0)

    def run(self, seconds: float, began: float, clock=time.perf_counter, sleep=time.sleep) -> float:
        """Hold the device for a step of ``seconds`` modelled time that began at
        ``began`` (on ``clock``): returns, once the step's share of the devices since
        ``began`` adds up to ``seconds``, the time on ``clock`` it did: its modelled end,
        without the last sleep's overshoot."""
        self._mm[self.slot] = 1
        try:
            done, t = 0.0, began
            while True:
                rate = min(1.0, self.num_devices / max(1, self.busy()))
                now = clock()
                done += (now - t) * rate
                t = now
                left = (seconds - done) / rate
                if left <= 0:
                    break
                sleep(min(left, QUANTUM_S))
            end = t + left  # left <= 0: the work ran out that long before t
        finally:
            self._mm[self.slot] = 0
        return end

    def close(self) -> None:
        if not self._mm.closed:
            self._mm[self.slot] = 0
            self._mm.close()
