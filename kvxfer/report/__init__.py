"""Statistics and reporting shared by ``kvxfer bench`` and ``kvxfer loadgen``.

- :mod:`.stats`: percentiles, :class:`~.stats.Summary`, decimal GB/s.
- :mod:`.envinfo`: the machine, load average, UCX build and commit a run measured on.
- :mod:`.output`: rich tables, warnings, a progress bar, ``--json`` files.
- :mod:`.plots`: PNG plots (bandwidth sweeps, latency CDFs).

Nothing here imports the library core, bench or loadgen: both sides import this.
"""
from __future__ import annotations

from . import envinfo, stats
from .output import console, fmt, human_bytes, print_table, progress, warn, write_json
from .plots import plot_bandwidth, plot_cdfs

__all__ = ["envinfo", "stats", "console", "fmt", "human_bytes", "print_table", "progress", "warn",
           "write_json", "plot_bandwidth", "plot_cdfs"]
