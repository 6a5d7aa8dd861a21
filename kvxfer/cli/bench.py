"""``kvxfer bench {pack,transfer,e2e}``: microbenchmarks.

Each benchmark kind is a module of :mod:`kvxfer.bench` exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them.
"""
from __future__ import annotations

import importlib

_KINDS = {
    "pack": ("kvxfer.bench.pack", "pack/unpack GB/s per model shape vs same-run memcpy"),
    "transfer": ("kvxfer.bench.transfer", "point-to-point write/read sweep between two processes"),
    "e2e": ("kvxfer.bench.e2e", "one request's KV moved pool to pool"),
}


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="microbenchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)
    for kind, (module_name, help_text) in _KINDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        parser = kinds.add_parser(kind, help=help_text)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)
