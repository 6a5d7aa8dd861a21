"""Which vLLM the connector runs on: the base-class methods it relies on, checked by shape.

vLLM's ``KVConnectorBase_V1`` is the contract: vLLM calls the methods the connector
overrides, with the base class's parameters. Instead of a list of version strings, the
connector checks at import that the installed base class still has every method it
overrides, each with the same parameters (names and kinds, ``self``/``cls`` aside) and
the same kind (method, classmethod, property). A vLLM that renamed, removed or
re-shaped one raises ``ImportError`` naming each difference. Methods that only newer
vLLMs call (:data:`OPTIONAL`: ``kv_cache_access``, ``supports_sleep_mode``,
``unregister_kv_caches``, ``restore_kv_caches``) may be absent; where present they
must match too.

The same check runs on a base class read from source (:func:`signatures_from_source`,
no import), so the signatures of vLLM releases not installed here are kept as test data
(``tests/data/vllm_base_signatures.json``) and checked against the connector.
"""
from __future__ import annotations

import ast
import inspect

# newer vLLMs call these; older ones lack them (0.32.0: all four absent)
OPTIONAL = frozenset({"kv_cache_access", "supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"})

_KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional_only",
          inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
          inspect.Parameter.VAR_POSITIONAL: "var_positional",
          inspect.Parameter.KEYWORD_ONLY: "keyword_only",
          inspect.Parameter.VAR_KEYWORD: "var_keyword"}


def signatures_of(cls, names=None) -> dict:
    """``{name: {"kind": ..., "params": [[name, kind], ...]}}`` of ``cls``'s own methods
    (``names``: those, looked up through the class's MRO), ``self``/``cls`` left out."""
    out = {}
    for name in (names if names is not None else list(vars(cls))):
        raw = inspect.getattr_static(cls, name, None)
        kind, func = _unwrap(raw)
        if func is None:
            continue
        params = list(inspect.signature(func).parameters.values())
        out[name] = {"kind": kind, "params": [[p.name, _KINDS[p.kind]] for p in params[1:]]}
    return out


def _unwrap(raw) -> tuple:
    if isinstance(raw, classmethod):
        return "classmethod", raw.__func__
    if isinstance(raw, staticmethod):
        return "staticmethod", raw.__func__
    if isinstance(raw, property):
        return "property", raw.fget
    if inspect.isfunction(raw):
        return "method", raw
    return None, None


def signatures_from_source(text: str, class_name: str = "KVConnectorBase_V1") -> dict:
    """:func:`signatures_of` for a class defined in Python source ``text`` (read with ``ast``,
    nothing imported): e.g. ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` of a release."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            break
    else:
        raise ValueError(f"no class {class_name} in the source")
    out = {}
    for fn in node.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
        a = fn.args
        params = [[p.arg, "positional_only"] for p in a.posonlyargs]
        params += [[p.arg, "positional_or_keyword"] for p in a.args]
        if a.vararg:
            params.append([a.vararg.arg, "var_positional"])
        params += [[p.arg, "keyword_only"] for p in a.kwonlyargs]
        if a.kwarg:
            params.append([a.kwarg.arg, "var_keyword"])
        out[fn.name] = {"kind": kind, "params": params[1:] if kind != "staticmethod" else params}
    return out


def overridden(connector_cls, base_cls) -> list:
    """Names the connector defines that vLLM calls: its own methods that the base class
    defines, or that newer bases do (:data:`OPTIONAL`)."""
    own = [n for n in vars(connector_cls) if _unwrap(inspect.getattr_static(connector_cls, n))[1] is not None]
    return sorted(n for n in own if (n == "__init__" or not n.startswith("__"))
                  and (hasattr(base_cls, n) or n in OPTIONAL))


def mismatches(base: dict, connector: dict) -> list:
    """Differences between a base class's signatures and the connector's overrides
    (both as :func:`signatures_of` gives them): a sentence each; empty if compatible."""
    problems = []
    for name, mine in sorted(connector.items()):
        theirs = base.get(name)
        if theirs is None:
            if name not in OPTIONAL:
                problems.append(f"KVConnectorBase_V1.{name} is missing")
            continue
        if theirs["kind"] != mine["kind"]:
            problems.append(f"KVConnectorBase_V1.{name} is a {theirs['kind']}, the connector's a {mine['kind']}")
        elif [list(p) for p in theirs["params"]] != [list(p) for p in mine["params"]]:
            problems.append(f"KVConnectorBase_V1.{name}({_fmt(theirs)}) differs from the connector's ({_fmt(mine)})")
    return problems


def _fmt(sig: dict) -> str:
    marks = {"var_positional": "*", "var_keyword": "**"}
    return ", ".join(marks.get(kind, "") + name for name, kind in sig["params"])


def check_installed(connector_cls, base_cls, version: str) -> None:
    """Raise ImportError naming every base-class method the connector relies on that the
    installed vLLM lacks or shapes differently."""
    names = overridden(connector_cls, base_cls)
    problems = mismatches(signatures_of(base_cls, names), signatures_of(connector_cls, names))
    if problems:
        raise ImportError(f"KVXferConnector cannot run on vLLM {version}: " + "; ".join(problems))
