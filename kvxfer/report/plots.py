"""PNG plots of a run (matplotlib, imported only when a plot is asked for).

- :func:`plot_bandwidth`: GB/s vs block size, one line per series (``kvxfer bench transfer``).
- :func:`plot_cdfs`: empirical latency CDFs, one panel per metric (``kvxfer loadgen``).
"""
from __future__ import annotations

from pathlib import Path


def plot_bandwidth(path: str | Path, series: dict[str, tuple[list[float], list[float]]],
                   *, title: str, xlabel: str = "block size (bytes)") -> None:
    """GB/s vs block size, one line per series (``name -> (x, y)``), log2 x axis, PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (xs, ys) in series.items():
        style = "--" if "limit" in name else "-"
        ax.plot(xs, ys, style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdfs(path: str | Path, panels: dict[str, dict[str, list[float]]], *, title: str) -> None:
    """One panel per metric (``metric -> {run label -> values}``), empirical CDFs, PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (metric, runs) in zip(axes[0], panels.items()):
        for label, values in runs.items():
            data = sorted(v for v in values if v is not None)
            if not data:
                continue
            ys = [(i + 1) / len(data) for i in range(len(data))]
            ax.step(data, ys, where="post", label=label)
        ax.set_xlabel(metric)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
