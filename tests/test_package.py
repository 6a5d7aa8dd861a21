import subprocess
import sys

import kvxfer


def test_errors_share_one_base():
    for name in ["TransferTimeout", "PeerDisconnected", "LayoutMismatch", "AuthenticationError",
                 "RegistrationError", "InvalidDescriptor", "TransferCancelled", "ProtocolError"]:
        assert issubclass(getattr(kvxfer, name), kvxfer.KVXferError)


def test_import_is_lazy():
    code = "import sys, kvxfer; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_unknown_attribute():
    import pytest

    with pytest.raises(AttributeError):
        kvxfer.does_not_exist


def _pyproject() -> dict:
    import tomllib
    from pathlib import Path

    return tomllib.loads((Path(kvxfer.__file__).parent.parent / "pyproject.toml").read_text())["project"]


def test_rich_is_only_in_the_extra_that_prints_with_it():
    """Only ``kvxfer.report`` (the output of bench and loadgen) uses rich: the ``bench`` extra
    installs it; neither the core nor another extra depends on it."""
    project = _pyproject()
    with_rich = {extra for extra, deps in project["optional-dependencies"].items()
                 if any(d.split(">")[0].split("=")[0].strip() == "rich" for d in deps)}
    assert not [d for d in project["dependencies"] if d.startswith("rich")]
    assert with_rich == {"bench"}


def test_rich_is_imported_only_when_something_prints():
    code = ("import sys, kvxfer.report, kvxfer.cli, kvxfer.bench, kvxfer.loadgen\n"
            "print('rich' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_missing_rich_names_the_extra(monkeypatch):
    import pytest

    from kvxfer.report import output

    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich.* raises ImportError
    with pytest.raises(ImportError, match=r"kvxfer\[bench\]"):
        output.console()
