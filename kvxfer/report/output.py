"""Output of a benchmark or load-generator run: a rich table, a progress bar, ``--json``.

A result is a list of *rows* (plain dicts, one per sweep point) plus the
environment from :mod:`kvxfer.report.envinfo`. Each row keeps every steady-state
sample under ``"samples"`` so a JSON file can be re-analysed later; the table
shows only the summary columns the caller names.
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

SCHEMA_VERSION = 1


def _rich(module: str):
    """``rich.<module>``, or an ImportError naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(f"rich.{module}")
    except ImportError as exc:
        raise ImportError("kvxfer bench and loadgen print with rich: pip install 'kvxfer[bench]'") from exc


def console(stderr: bool = False, *, min_width: int | None = None):
    """A rich console; when output is not a terminal (logs, CI, pipes) tables get 200
    columns instead of rich's 80, so wide benchmark tables are not folded;
    ``min_width`` widens a narrower terminal's console."""
    import sys

    stream = sys.stderr if stderr else sys.stdout
    out = _rich("console").Console(stderr=stderr, highlight=False,
                                   width=None if stream.isatty() else 200)
    if min_width is not None and out.width < min_width:
        out.width = min_width
    return out


def fmt(value, digits: int = 2) -> str:
    """Table cell text: NaN/None as '-', floats rounded, ints and strings as they are."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:.{digits}f}"
    return str(value)


def human_bytes(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def print_table(title: str, columns: Sequence[tuple[str, str]], rows: Iterable[dict],
                *, out=None, caption: str | None = None) -> None:
    """Print ``rows`` with ``columns`` given as ``(header, row_key)`` pairs."""
    table = _rich("table").Table(title=title, caption=caption, show_lines=False)
    for header, _ in columns:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(fmt(row.get(key)) for _, key in columns))
    (out or console()).print(table)


def warn(message: str, *, out=None) -> None:
    (out or console(stderr=True)).print(f"[bold yellow]warning:[/] {message}")


@contextlib.contextmanager
def progress(total: int, description: str, *, enabled: bool = True):
    """A progress bar on stderr; yields ``advance()`` (a no-op when disabled or not a TTY-less run)."""
    if not enabled:
        yield lambda n=1: None
        return
    rp = _rich("progress")
    with rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                     rp.TimeElapsedColumn(), console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def _jsonable(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None  # strict JSON has no NaN/inf
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "as_dict"):
        return _jsonable(obj.as_dict())
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    return obj


def write_json(path: str | Path, *, benchmark: str, args: dict, environment: dict,
               rows: list[dict], extra: dict | None = None) -> None:
    """Write one run: schema version, benchmark name, arguments, environment, rows (with samples)."""
    doc = {"schema": SCHEMA_VERSION, "benchmark": benchmark, "args": args,
           "environment": environment, "rows": rows}
    if extra:
        doc.update(extra)
    Path(path).write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
