"""The package's import graph, read with ``ast`` (nothing is imported to check it):

- the library core never imports serving, bench, loadgen, cli, integrations, report or store;
- report (shared by bench and loadgen) imports no other kvxfer module, and loadgen
  and report never import bench;
- the parts of serving (model, engine, simulated, channel, server, workers) import each
  other without a cycle: the router (server) and the workers meet in the channel; and
  kvxfer's packages import each other without a cycle (the planner, sim, runs serving's
  simulated engine; serving never imports the planner);
- the library's clients -- bench, loadgen, serving, integrations and sim -- reach it
  only through its public surface: the names in ``__all__`` of the modules in
  ``PUBLIC_MODULES`` (docs/api.md, "Public surface"), plus their own package and the
  clients they are built on (``OPEN``); never an underscore name or an internal module.
  The store is part of the library (``kvxfer.KVStore``, built on the agent stage), so
  it is not a client.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvxfer

ROOT = Path(kvxfer.__file__).parent
CORE = ["*.py", "agent/*.py", "transport/*.py", "kernels/*.py"]
OUTSIDE_CORE = ("serving", "bench", "loadgen", "cli", "integrations", "report", "store")
PUBLIC_MODULES = ("kvxfer", "kvxfer.errors", "kvxfer.kernels", "kvxfer.transport", "kvxfer.secrets",
                  "kvxfer.framing", "kvxfer.store", "kvxfer.discovery", "kvxfer.config", "kvxfer.auth",
                  "kvxfer.net", "kvxfer.fields")
# client -> the other packages it is built on, any of whose modules it may import
OPEN = {
    "bench": ("kvxfer.report",),
    "serving": (),
    "loadgen": ("kvxfer.report",),
    "integrations": ("kvxfer.serving.model",),  # export-hf: the embedded model's GGUF reader
    # the real scheduler, block manager and runtime, forward pass modelled; the store
    # nodes' own index and placement, no bytes moved (kvxfer simulate --store); a trace
    # slice read and scored as kvxfer loadgen reads and scores it (kvxfer plan)
    "sim": ("kvxfer.serving", "kvxfer.store", "kvxfer.loadgen"),
}
CLIENTS = tuple(OPEN)


def imports(path: Path, source: str | None = None) -> list[tuple[str, str | None]]:
    """``(absolute module, imported name or None)`` for every import in ``path``, a file of
    the package (``source`` overrides its text)."""
    package = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]  # e.g. (kvxfer, bench)
    out = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            out += [(module, a.name) for a in node.names]
    return out


def _public_names(module: str) -> set:
    return set(importlib.import_module(module).__all__)


def public_surface_violations(path: Path, source: str | None = None) -> list[str]:
    """Imports of ``path`` (a file of one of the ``CLIENTS``) outside the public surface."""
    own = ".".join(path.relative_to(ROOT.parent).parts[:2])  # e.g. kvxfer.bench

    def open_module(module: str) -> bool:  # any public name of it may be imported
        return any(module == m or module.startswith(m + ".") for m in (own, *OPEN[own.split(".")[1]]))

    bad = []
    for module, name in imports(path, source):
        if module != "kvxfer" and not module.startswith("kvxfer."):
            continue
        parts = module.split(".") + ([name] if name else [])
        if any(p.startswith("_") for p in parts[1:]):
            bad.append(f"{module}.{name} (private)")
        elif module in PUBLIC_MODULES:
            sub = f"{module}.{name}"
            if name is not None and name not in _public_names(module) and not (
                    sub in PUBLIC_MODULES or open_module(sub)):
                bad.append(f"{sub} (not in {module}.__all__)")
        elif not open_module(module):
            bad.append(f"{module} (internal module)")
    return bad


def _files(*patterns: str) -> list[Path]:
    return sorted(p for pattern in patterns for p in ROOT.glob(pattern))


def test_core_imports_nothing_above_it():
    for path in _files(*CORE):
        above = {m for m, _ in imports(path) if m.split(".")[:2][-1] in OUTSIDE_CORE and m.startswith("kvxfer.")}
        assert not above, f"{path.relative_to(ROOT)} imports {above}"


def test_report_is_below_bench_and_loadgen():
    assert ("kvxfer.report.stats", "summarize") in imports(ROOT / "loadgen" / "metrics.py")
    for path in _files("loadgen/*.py", "report/*.py"):
        bad = {m for m, _ in imports(path) if m.startswith("kvxfer.bench")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    for path in _files("report/*.py"):
        bad = {m for m, _ in imports(path) if m.startswith("kvxfer.") and not m.startswith("kvxfer.report")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def package_edges(area: str) -> dict[str, set[str]]:
    """Sub-package of ``kvxfer.<area>`` -> the sub-packages of it that its modules import."""
    edges: dict[str, set[str]] = {}
    for path in _files(f"{area}/*/*.py"):
        part = path.parent.name
        prefix = f"kvxfer.{area}."
        edges.setdefault(part, set()).update(
            m[len(prefix):].split(".")[0] for m, _ in imports(path) if m.startswith(prefix)
        )
        edges[part].discard(part)
    return edges


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph ``edges`` as ``[a, b, ..., a]``, or ``[]``."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for nxt in sorted(edges.get(node, ())):
            if found := visit(nxt, path + [node]):
                return found
        done.add(node)
        return []

    for start in sorted(edges):
        if found := visit(start, []):
            return found
    return []


def test_serving_parts_import_each_other_without_a_cycle():
    edges = package_edges("serving")
    assert {"model", "engine", "channel", "server", "workers"} <= set(edges)
    assert not cycle(edges), f"import cycle in kvxfer/serving: {' -> '.join(cycle(edges))}"
    assert "server" not in edges["workers"] and "workers" not in edges["server"]


def test_the_cycle_check_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


@pytest.mark.parametrize("area", CLIENTS)
def test_clients_use_the_public_surface_only(area):
    paths = _files(f"{area}/*.py", f"{area}/*/*.py")
    assert paths
    for path in paths:
        bad = public_surface_violations(path)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("source, found", [
    ("from .._native import load", "kvxfer._native.load (private)"),
    ("from ..kernels.cpu import num_threads", "kvxfer.kernels.cpu (internal module)"),
    ("from ..kernels import prepare_pack", "kvxfer.kernels.prepare_pack (not in kvxfer.kernels.__all__)"),
    ("import kvxfer.agent.sender", "kvxfer.agent.sender (internal module)"),
    ("from ..agent import Agent", "kvxfer.agent (internal module)"),
    ("from .endpoint import _pattern", "kvxfer.bench.endpoint._pattern (private)"),
    ("from .. import runs", "kvxfer.runs (not in kvxfer.__all__)"),
    ("from ..loadgen.trace import TraceRequest", "kvxfer.loadgen.trace (internal module)"),
    ("from ..framing import _recv_exact", "kvxfer.framing._recv_exact (private)"),
    ("from ..secrets import os", "kvxfer.secrets.os (not in kvxfer.secrets.__all__)"),
    ("from ..config import ENV_OVERRIDES", "kvxfer.config.ENV_OVERRIDES (not in kvxfer.config.__all__)"),
    ("from ..store.node import StoreNode", "kvxfer.store.node (internal module)"),
    ("from ..serving.model.tokenizer import Tokenizer", "kvxfer.serving.model.tokenizer (internal module)"),
])
def test_the_check_finds_private_and_internal_imports(source, found):
    assert public_surface_violations(ROOT / "bench" / "probe.py", source) == [found]


@pytest.mark.parametrize("path, source, found", [
    ("serving/workers/probe.py", "from ...agent import Agent", "kvxfer.agent (internal module)"),
    ("serving/server/probe.py", "from ...agent.peers import split_address", "kvxfer.agent.peers (internal module)"),
    ("serving/model/probe.py", "from kvxfer.layout import KVLayout", "kvxfer.layout (internal module)"),
    ("integrations/probe.py", "from ..serving.server.api import ChatRequest",
     "kvxfer.serving.server.api (internal module)"),
    ("sim/probe.py", "from ..agent.peers import split_address", "kvxfer.agent.peers (internal module)"),
])
def test_the_check_covers_serving_integrations_and_sim(path, source, found):
    assert public_surface_violations(ROOT / path, source) == [found]


def test_the_check_allows_the_public_surface():
    source = ("import kvxfer\nfrom .. import Agent, KVLayout, pack, kernels\nfrom ..errors import KVXferError\n"
              "from ..transport import make_backend\nfrom ..kernels import num_threads\n"
              "from .. import report\nfrom ..report.stats import summarize\nfrom .copy_limit import MemcpyLimit\n"
              "from ..secrets import load_secret\nfrom ..framing import json_frame\nfrom ..store import KVStore\n"
              "from ..discovery import open_discovery\n"
              "from ..config import PREAUTH_MAX_FRAME\nfrom ..auth import HmacChallenge\nfrom .. import CostModel\n")
    assert public_surface_violations(ROOT / "bench" / "probe.py", source) == []
    source = ("from ... import Agent\nfrom ...net import split_address\nfrom ..engine.config import EngineConfig\n"
              "from ..simulated.runtime import SimRuntime\n")
    assert public_surface_violations(ROOT / "serving" / "workers" / "probe.py", source) == []


def hmac_calls(source: str) -> int:
    """Calls of ``hmac.new``/``hmac.digest`` in ``source``: where a proof of the secret is made."""
    return sum(1 for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in ("new", "digest") and isinstance(node.func.value, ast.Name)
               and node.func.value.id == "hmac")


def test_one_hmac_challenge():
    """Every protocol proves the shared secret through ``auth.py``'s ``HmacChallenge``
    (a domain of its own each), never with an HMAC of its own."""
    makers = [p.relative_to(ROOT).as_posix() for p in _files("*.py", "*/*.py", "*/*/*.py")
              if hmac_calls(p.read_text())]
    assert makers == ["auth.py"]
    assert hmac_calls("import hmac\nhmac.new(k, m, 'sha256').digest()\n") == 1


def test_nothing_outside_the_agent_imports_its_internals():
    """The agent's modules are its own: every other part of the package (the store, the
    serving stack, the CLI, ...) reaches it through ``kvxfer.agent`` (``Agent``, ``Peer``)
    or the root package; authentication and sockets are ``kvxfer.auth`` / ``kvxfer.net``."""
    bad = []
    for path in _files("*.py", "*/*.py", "*/*/*.py", "*/*/*/*.py"):
        if path.parent.name == "agent" and path.parent.parent == ROOT:
            continue
        bad += [f"{path.relative_to(ROOT)}: {m}" for m, _ in imports(path) if m.startswith("kvxfer.agent.")]
    assert bad == []


def test_the_root_package_exports_the_user_api_not_plumbing():
    assert not {"split_address", "HandshakeGate", "HmacChallenge"} & set(kvxfer.__all__)


def test_packages_import_each_other_without_a_cycle():
    """Top-level packages of kvxfer (agent, store, serving, sim, cli, ...) -> the others
    their modules import: no cycle, none allowed."""
    edges: dict[str, set[str]] = {}
    for path in _files("*/*.py", "*/*/*.py", "*/*/*/*.py"):
        part = path.relative_to(ROOT).parts[0]
        edges.setdefault(part, set()).update(
            m.split(".")[1] for m, _ in imports(path) if m.startswith("kvxfer.") and (ROOT / m.split(".")[1]).is_dir())
        edges[part].discard(part)
    assert not cycle(edges), f"import cycle between packages: {' -> '.join(cycle(edges))}"
    assert "sim" not in edges["serving"]
