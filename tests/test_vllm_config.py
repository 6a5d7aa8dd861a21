"""KVXferConnector settings (roles, secret from config or $KVXFER_SECRET, limits) and
the vLLM version gate."""
from __future__ import annotations

import types

import pytest

from kvxfer.integrations.vllm_config import SECRET_ENV, ConnectorConfig


def kv_config(role="kv_producer", **extra):
    return types.SimpleNamespace(kv_role=role, kv_connector_extra_config=extra)


def test_secret_from_config_or_env():
    c = ConnectorConfig.from_vllm(kv_config(secret="s" * 16, listen="127.0.0.1:7001"), environ={})
    assert (c.role, c.secret, c.listen) == ("producer", b"s" * 16, "127.0.0.1:7001")
    c = ConnectorConfig.from_vllm(kv_config("kv_consumer", secret="s" * 16), environ={SECRET_ENV: "e" * 20})
    assert (c.role, c.secret) == ("consumer", b"e" * 20)


@pytest.mark.parametrize("role,extra", [
    ("kv_producer", {}),                                          # no secret at all
    ("kv_producer", {"secret": "short"}),                         # < 16 bytes
    ("kv_both", {"secret": "s" * 16}),                            # role kvxfer does not serve
    ("kv_producer", {"secret": "s" * 16, "lease_timeout": 0}),
    ("kv_producer", {"secret": "s" * 16, "path": "fast"}),
    ("kv_producer", {"secret": "s" * 16, "listne": "x"}),         # typo: refused, not ignored
    ("kv_producer", {"secret": "s" * 16, "idle_wait_ms": -1}),
    ("kv_producer", {"secret": "s" * 16, "idle_wait_ms": 5000}),  # would stall an engine step
])
def test_bad_settings_are_value_errors(role, extra):
    with pytest.raises(ValueError):
        ConnectorConfig.from_vllm(kv_config(role, **extra), environ={})


def test_version_gate_names_supported_versions(monkeypatch):
    pytest.importorskip("vllm")
    from kvxfer.integrations import vllm as connector

    connector.check_version(connector.SUPPORTED_VLLM[0])
    monkeypatch.delenv("KVXFER_VLLM_ANY_VERSION", raising=False)
    with pytest.raises(ImportError, match="supports vLLM 0.32.0; found vLLM 0.9.1"):
        connector.check_version("0.9.1")
    monkeypatch.setenv("KVXFER_VLLM_ANY_VERSION", "1")
    connector.check_version("0.9.1")


def test_store_settings():
    c = ConnectorConfig.from_vllm(kv_config("kv_both", secret="s" * 16, store="10.0.0.5:7600, 10.0.0.6:7600"),
                                  environ={})
    assert (c.role, c.store, c.store_put_blocks) == ("both", ("10.0.0.5:7600", "10.0.0.6:7600"), 1024)
    c = ConnectorConfig.from_vllm(kv_config(secret="s" * 16, store=["h:1"], store_salt="sha256:ab"), environ={})
    assert (c.role, c.store, c.store_salt) == ("producer", ("h:1",), "sha256:ab")
    c = ConnectorConfig.from_vllm(kv_config("kv_consumer", secret="s" * 16, store="etcd://e:2379/p"), environ={})
    assert c.store == "etcd://e:2379/p"
    assert ConnectorConfig.from_vllm(kv_config(secret="s" * 16), environ={}).store is None


@pytest.mark.parametrize("extra", [
    {"store": 7600},                      # neither a URL nor addresses
    {"store": ["h:1", 2]},
    {"store": " , "},                     # names no node
    {"store": "h:1", "store_put_blocks": 0},
    {"store": "h:1", "store_timeout": 0},
])
def test_bad_store_settings_are_value_errors(extra):
    with pytest.raises(ValueError):
        ConnectorConfig.from_vllm(kv_config("kv_both", secret="s" * 16, **extra), environ={})
