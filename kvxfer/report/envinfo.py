"""The environment a benchmark or load run ran in, and whether the machine was busy.

Recorded in every ``--json`` file so a number can be traced to the machine,
the UCX build and the commit that produced it. :func:`busy_warning` checks the
1-minute load average before a run: a number measured while other processes
compete for the cores is not a number about kvxfer.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

# load average per core above which results are flagged as measured on a busy machine
BUSY_LOAD_PER_CORE = 0.5


def ucx_dir() -> Path | None:
    """The ``libucx`` wheel's install directory (holds ``bin/`` and ``lib/``), if installed."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def ucx_tool(name: str) -> tuple[str, dict] | None:
    """Path of a UCX tool (``ucx_info``, ``ucx_perftest``) and the env it needs to run.

    Prefers the wheel's binary (which needs the wheel's ``lib/`` on ``LD_LIBRARY_PATH``),
    then one on ``PATH``.
    """
    base = ucx_dir()
    env = dict(os.environ)
    if base is not None and (base / "bin" / name).exists():
        lib = str(base / "lib")
        env["LD_LIBRARY_PATH"] = lib + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        return str(base / "bin" / name), env
    found = shutil.which(name)
    return (found, env) if found else None


def ucx_version() -> str | None:
    """UCX library version: ``ucx_info -v`` if it runs, else the ``libucx`` wheel's version."""
    tool = ucx_tool("ucx_info")
    if tool is not None:
        try:
            out = subprocess.run([tool[0], "-v"], env=tool[1], capture_output=True, text=True, timeout=10)
            for line in out.stdout.splitlines():
                if "Library version:" in line:
                    return line.split(":", 1)[1].strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import libucx

        return str(libucx.__version__)
    except ImportError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The commit of the kvxfer checkout (``+dirty`` if modified), or None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        # result files being (re)written by the run itself do not make the code dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"],
                               cwd=root, capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def busy_warning(threshold_per_core: float = BUSY_LOAD_PER_CORE) -> str | None:
    """A warning line if the 1-minute load average exceeds ``threshold_per_core`` × cores."""
    load1 = load_average()[0]
    cores = num_cores()
    if load1 > threshold_per_core * cores:
        return (f"machine busy: 1-min load average {load1:.2f} on {cores} cores "
                f"(> {threshold_per_core:g}/core); numbers below are noisy, "
                f"compare only ratios measured in this run")
    return None


def huge_pages() -> dict:
    """The transparent-huge-page modes (the bracketed choice of each sysfs file; None if absent):
    ``anon`` for private memory, ``shmem`` for shared memory such as ``kvxfer.shared_empty``."""
    out = {}
    for key, name in (("anon", "enabled"), ("shmem", "shmem_enabled")):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                text = f.read()
            out[key] = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            out[key] = None
    return out


def collect(**extra) -> dict:
    """Everything recorded about the environment; ``extra`` adds run-specific fields."""
    torch_version = None
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        pass
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "num_cores": num_cores(),
        "load_average": list(load_average()),
        "busy_warning": busy_warning(),
        "ucx_version": ucx_version(),
        "ucx_tls": os.environ.get("UCX_TLS"),
        "torch": torch_version,
        "git_commit": git_commit(),
        "transparent_huge_pages": huge_pages(),
    }
    info.update(extra)
    return info
