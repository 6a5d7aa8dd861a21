"""benchmarks/vclock_validate_summary.py: the virtual clock against the mean of several
wall-clock runs, per configuration and routing; files of other setups are refused."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("vclock_validate_summary",
                                                  ROOT / "benchmarks" / "vclock_validate_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, name, walls, *, routing="least-loaded", dilate=8.0, vclock=(3.5, 1.0)):
    configs = [{"config": cfg, "goodput_ratio": vclock[0] / g,
                "vclock": {"goodput_rps": vclock[0], "slo_attainment": vclock[1]},
                "wall": {"summary": {"goodput": g, "slo_attainment": a}}} for cfg, g, a in walls]
    doc = {"args": {"configs": [c[0] for c in walls], "routing": routing, "dilate": dilate, "port": 1,
                    "out": str(tmp_path / name), "slo": "2500,150"}, "configs": configs}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_ratios_against_the_mean_of_the_runs_per_config_and_routing(tmp_path):
    mod = _module()
    files = [_run(tmp_path, "a.json", [("2P6D", 3.0, 0.9), ("colocated:8", 3.5, 1.0)]),
             _run(tmp_path, "b.json", [("2P6D", 4.0, 1.0)]),
             _run(tmp_path, "c.json", [("2P6D", 3.5, 1.0)], routing="kv")]
    rows = {(r["config"], r["routing"]): r for r in mod.summarize(files)}
    ll = rows["2P6D", "least-loaded"]
    assert ll["runs"] == 2 and ll["wall_goodput_mean"] == pytest.approx(3.5)
    assert ll["goodput_ratio"] == pytest.approx(1.0)  # 3.5 against the mean, though each run is 7/6 or 7/8
    assert ll["attainment_ratio"] == pytest.approx(1.0 / 0.95)
    assert sorted(ll["run_goodput_ratios"]) == pytest.approx([3.5 / 4.0, 3.5 / 3.0])
    assert rows["2P6D", "kv"]["runs"] == 1 and rows["colocated:8", "least-loaded"]["runs"] == 1


def test_runs_of_another_setup_or_virtual_clock_are_refused(tmp_path):
    mod = _module()
    a = _run(tmp_path, "a.json", [("2P6D", 3.0, 0.9)])
    with pytest.raises(SystemExit, match="dilate"):
        mod.summarize([a, _run(tmp_path, "b.json", [("2P6D", 3.0, 0.9)], dilate=1.0)])
    with pytest.raises(SystemExit, match="virtual clock differs"):
        mod.summarize([a, _run(tmp_path, "c.json", [("2P6D", 3.0, 0.9)], vclock=(3.6, 1.0))])
