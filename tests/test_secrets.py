"""The shared secret is loaded in one place: kvxfer.secrets.load_secret (a file, else
$KVXFER_SECRET, else a default), and no other module of the package reads the variable."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvxfer
from kvxfer.secrets import MIN_SECRET_BYTES, SECRET_ENV, has_secret, load_secret

ROOT = Path(kvxfer.__file__).parent


def test_a_file_wins_then_the_variable_then_the_default(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"f" * 20 + b"\n")
    environ = {SECRET_ENV: "e" * 20}
    assert load_secret(str(path), environ=environ, default="d" * 20) == b"f" * 20
    assert load_secret(environ=environ, default="d" * 20) == b"e" * 20
    assert load_secret(environ={}, default="d" * 20) == b"d" * 20
    assert environ == {SECRET_ENV: "e" * 20}  # read, left in place


def test_remove_takes_the_variable_out():
    environ = {SECRET_ENV: "e" * 20, "OTHER": "x"}
    assert load_secret(environ=environ, remove=True) == b"e" * 20
    assert environ == {"OTHER": "x"}


def test_absent_short_or_unreadable_is_a_typed_error(tmp_path):
    with pytest.raises(ValueError, match=SECRET_ENV):
        load_secret(environ={})
    with pytest.raises(ValueError):
        load_secret(environ={SECRET_ENV: "x" * (MIN_SECRET_BYTES - 1)})
    with pytest.raises(OSError):
        load_secret(str(tmp_path / "missing"), environ={})
    assert not has_secret(environ={}) and has_secret("/any/file", environ={})
    assert has_secret(environ={SECRET_ENV: "x"})


def secret_reads(source: str) -> list[int]:
    """Lines of ``source`` that read the secret's variable from an environment: the name
    spelled out, or ``SECRET_ENV`` (under any alias) used as a key to get, pop or index."""
    tree = ast.parse(source)
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for a in node.names if a.name == "SECRET_ENV"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == SECRET_ENV:
            lines.append(node.lineno)
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and node.func.attr in ("get", "pop", "setdefault", "getenv"):
            key = node.args[0]
        elif isinstance(node, ast.Subscript):
            key = node.slice
        if isinstance(key, ast.Name) and key.id in aliases:
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("source", [
    'import os\nx = os.environ.get("KVXFER_SECRET")\n',
    "from ..secrets import SECRET_ENV as S\ndef f(environ):\n    return environ.pop(S)\n",
    "from kvxfer.secrets import SECRET_ENV\nimport os\ny = os.environ[SECRET_ENV]\n",
])
def test_the_check_finds_a_read(source):
    assert secret_reads(source)


def test_only_kvxfer_secrets_reads_the_variable():
    bad = {str(p.relative_to(ROOT)): lines for p in sorted(ROOT.rglob("*.py"))
           if p.name != "secrets.py" or p.parent != ROOT
           if (lines := secret_reads(p.read_text()))}
    assert not bad, f"read {SECRET_ENV} outside kvxfer/secrets.py: {bad}"
