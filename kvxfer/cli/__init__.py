"""The ``kvxfer`` command: ``bench``, ``serve``, ``worker``, ``store``, ``loadgen``, ``profile``, ``simulate``, ``plan``, ``export-hf``, ``proxy``.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``,
which registers its arguments and sets ``func`` (``args -> int`` exit code).
Modules are imported only to build the parser; heavy imports stay inside
``func``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# module path, in the order shown by --help
_COMMANDS = ("kvxfer.cli.bench", "kvxfer.cli.serve", "kvxfer.cli.worker", "kvxfer.cli.store", "kvxfer.cli.loadgen", "kvxfer.cli.profile", "kvxfer.cli.simulate", "kvxfer.cli.plan",
             "kvxfer.cli.export_hf", "kvxfer.cli.proxy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
