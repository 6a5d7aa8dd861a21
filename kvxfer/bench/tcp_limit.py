"""The TCP limit: a plain loopback TCP socket between two processes, in native code.

``tcp_limit.c`` (beside this file) is compiled on first use with the system C
compiler (``$CC``, else ``cc``; the same toolchain that builds ``kvxfer._C``) into
a per-user cache directory keyed by the source's hash, then run once per row:
N-byte messages, each acknowledged by the receiver with one byte, warm-up dropped.
Where no compiler exists :class:`SocketLimit` raises
:class:`~kvxfer.errors.KVXferError` and the caller reports the limit as not
measured; there is no interpreted fallback (a Python loop is not a limit).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import KVXferError, TransferTimeout

SOURCE = Path(__file__).with_name("tcp_limit.c")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(tempfile.gettempdir(), f"kvxfer-{os.getuid()}")
    return Path(base) / "kvxfer-bench"


def build(timeout: float = 120.0) -> Path:
    """Path of the compiled ``tcp_limit`` program (compiled now if not cached)."""
    src = SOURCE.read_bytes()
    exe = _cache_dir() / f"tcp_limit-{hashlib.sha256(src).hexdigest()[:16]}"
    if exe.exists():
        return exe
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KVXferError("no C compiler (cc/gcc, or $CC) to build the native TCP limit")
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
    try:
        res = subprocess.run([cc, "-O2", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KVXferError(f"building the native TCP limit failed: {exc}") from exc
    if res.returncode != 0:
        raise KVXferError(f"building the native TCP limit failed: {res.stderr.strip()[-500:]}")
    os.replace(tmp, exe)  # atomic: concurrent builders never run a half-written file
    return exe


class SocketLimit:
    """Seconds per ``nbytes`` message over loopback TCP, delivered and acknowledged.

    A context manager for symmetry with the sessions it is measured beside; the
    program is built on ``__enter__`` (so a missing compiler fails before any
    measurement) and each :meth:`seconds` call runs one sender/sink pair.
    """

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self._exe: Path | None = None

    def __enter__(self) -> "SocketLimit":
        self._exe = build()
        return self

    def seconds(self, nbytes: int, iters: int, warmup: int = 2) -> list[float]:
        """``iters`` samples in seconds, after ``warmup`` discarded messages."""
        if nbytes <= 0 or iters <= 0 or warmup < 0:
            raise ValueError("nbytes and iters must be positive, warmup >= 0")
        if self._exe is None:
            raise RuntimeError("SocketLimit used outside its context")
        try:
            res = subprocess.run([str(self._exe), str(nbytes), str(iters), str(warmup)],
                                 capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as exc:
            raise TransferTimeout(f"TCP limit: {iters} messages not done within {self.timeout}s") from exc
        if res.returncode != 0:
            raise KVXferError(f"TCP limit failed: {res.stderr.strip()[-300:]}")
        samples = [float(line) for line in res.stdout.split()]
        if len(samples) != iters:
            raise KVXferError(f"TCP limit printed {len(samples)} samples, expected {iters}")
        return samples

    def close(self) -> None:
        self._exe = None

    def __exit__(self, *exc) -> None:
        self.close()
