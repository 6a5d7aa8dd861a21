"""KVXferConnector settings (roles, secret from config or $KVXFER_SECRET, limits) and
the check of vLLM's base class (the methods the connector overrides, by signature),
against the installed vLLM and against the recorded 0.32.0 and 0.34.0 base classes."""
from __future__ import annotations

import json
import os
import types

import pytest

from kvxfer.integrations.vllm.config import SECRET_ENV, ConnectorConfig


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
    ("kv_producer", {"secret": "s" * 16, "layerwise": "yes"}),    # a bool, not a string
])
def test_bad_settings_are_value_errors(role, extra):
    with pytest.raises(ValueError):
        ConnectorConfig.from_vllm(kv_config(role, **extra), environ={})


SIGNATURES = os.path.join(os.path.dirname(__file__), "data", "vllm_base_signatures.json")


def _connector():
    pytest.importorskip("vllm")
    from kvxfer.integrations.vllm import connector
    from kvxfer.integrations.vllm.api import overridden, signatures_of

    names = overridden(connector.KVXferConnector, connector.KVConnectorBase_V1)
    return connector, signatures_of(connector.KVXferConnector, names)


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_overrides_match_the_recorded_base_classes(version):
    """Every method the connector overrides has the recorded base class's parameters;
    0.34.0's additions (kv_cache_access, supports_sleep_mode) are overridden too."""
    from kvxfer.integrations.vllm.api import mismatches

    _, mine = _connector()
    with open(SIGNATURES) as f:
        base = json.load(f)[version]
    assert mismatches(base, mine) == []
    for name in ("save_kv_layer", "wait_for_save", "get_transfer_results", "request_finished",
                 "register_kv_caches", "start_load_kv", "__init__"):
        assert name in mine and name in base
    if version == "0.34.0":
        assert {"kv_cache_access", "supports_sleep_mode"} <= set(mine) & set(base)


def test_recorded_032_is_the_installed_base_class():
    """The 0.32.0 record (read from source with ast) is what inspect sees in the installed vLLM."""
    import vllm

    from kvxfer.integrations.vllm.api import signatures_from_source, signatures_of

    connector, _ = _connector()
    if vllm.__version__.split("+")[0] != "0.32.0":
        pytest.skip(f"vLLM {vllm.__version__} installed")
    with open(SIGNATURES) as f:
        recorded = json.load(f)["0.32.0"]
    assert signatures_of(connector.KVConnectorBase_V1) == recorded
    path = os.path.join(os.path.dirname(vllm.__file__), "distributed/kv_transfer/kv_connector/v1/base.py")
    with open(path) as f:
        assert signatures_from_source(f.read()) == recorded


def test_a_reshaped_or_missing_base_method_is_an_import_error():
    from kvxfer.integrations.vllm.api import check_installed, mismatches

    connector, mine = _connector()
    with open(SIGNATURES) as f:
        base = json.load(f)["0.34.0"]
    base = dict(base, save_kv_layer={"kind": "method", "params": [["layer_name", "positional_or_keyword"],
                                                                   ["kv_layer", "positional_or_keyword"]]})
    del base["get_transfer_results"]
    problems = mismatches(base, mine)
    assert any("save_kv_layer(layer_name, kv_layer) differs" in p for p in problems), problems
    assert "KVConnectorBase_V1.get_transfer_results is missing" in problems

    class Renamed(connector.KVConnectorBase_V1):  # a base whose wait_for_save takes an argument
        def wait_for_save(self, layer_name):
            pass

    class Over(Renamed):
        wait_for_save = connector.KVXferConnector.wait_for_save

    with pytest.raises(ImportError, match=r"vLLM 9\.9: .*wait_for_save\(layer_name\) differs"):
        check_installed(Over, Renamed, "9.9")


def test_sleep_mode_is_refused_and_registration_declared():
    connector, _ = _connector()
    assert connector.KVXferConnector.supports_sleep_mode(None) is False
    if connector.KVCacheAccess is not None:  # vLLM >= 0.34
        assert connector.KVXferConnector.kv_cache_access(None) == connector.KVCacheAccess.REGISTERS


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
