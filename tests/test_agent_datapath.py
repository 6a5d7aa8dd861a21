"""The agent's data path is one module with a three-method report (read from the source)."""
from __future__ import annotations

import ast
import pathlib

import kvxfer.agent

AGENT = pathlib.Path(kvxfer.agent.__file__).parent
MOVERS = {("backend", "post"), ("backend", "wait"), ("backend", "test"), ("device", "pack"),
          ("device", "unpack"), ("device", "wait")}


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            yield name, node.func.attr, node.lineno


def test_only_datapath_moves_bytes():
    found = {}
    for path in sorted(AGENT.glob("*.py")):
        for owner, method, line in _calls(ast.parse(path.read_text())):
            if (owner, method) in MOVERS:
                found.setdefault(path.name, []).append(f"{owner}.{method}:{line}")
    assert set(found) == {"datapath.py"}, found


def test_datapath_reports_to_the_sender_through_visible_failed_finished_only():
    tree = ast.parse((AGENT / "datapath.py").read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "_sender"}
    assert used == {"visible", "failed", "finished"}
