"""benchmarks/vllm_pd_overhead.py: D's recv over every D rank, from the connector's log lines."""
import importlib.util
import json
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "vllm_pd_overhead", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "vllm_pd_overhead.py"))
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

# as two D ranks log them (vLLM's prefix, then the connector's line); an earlier request first
LOG = """\
(Worker_TP0 pid=2455) INFO 12-07 12:12:50 [worker.py:283] kvxfer: loaded cmpl-a-0: 62914560 B in 0.030000 s (path zero_copy) at 100.000000
(Worker_TP1 pid=2456) INFO 12-07 12:12:50 [worker.py:283] kvxfer: loaded cmpl-a-0: 62914560 B in 0.020000 s (path zero_copy) at 100.010000
(Worker_TP1 pid=2456) INFO 12-07 12:13:07 [worker.py:283] kvxfer: loaded cmpl-b-0: 62914560 B in 0.019919 s (path zero_copy) at 23273.178399
(APIServer pid=2400) INFO 12-07 12:13:07 [loggers.py:335] Engine 000: Avg prompt throughput: 0.0 tokens/s
(Worker_TP0 pid=2455) INFO 12-07 12:13:07 [worker.py:283] kvxfer: loaded cmpl-b-0: 62914560 B in 0.045279 s (path packed) at 23273.204913
"""


def test_recv_adds_every_rank_of_the_last_request():
    nbytes, secs = bench.kvxfer_recv(LOG)
    assert nbytes == 2 * 62914560  # both ranks' halves, not the last line's
    # TP1's post (23273.178399 - 0.019919) came first; TP0's data landed last
    assert secs == pytest.approx(23273.204913 - (23273.178399 - 0.019919), abs=1e-6)


def test_recv_one_rank():
    nbytes, secs = bench.kvxfer_recv(LOG.splitlines()[0])
    assert (nbytes, secs) == (62914560, pytest.approx(0.03))


def test_recv_without_a_line_is_an_error():
    with pytest.raises(RuntimeError, match="no kvxfer recv"):
        bench.kvxfer_recv("INFO nothing here\n")


def test_json_appends_invocations(tmp_path):
    path = str(tmp_path / "r.json")
    bench.append_json(path, {"connector": "kvxfer"})
    bench.append_json(path, {"connector": "nixl"})
    with open(path) as f:
        doc = json.load(f)
    assert [e["connector"] for e in doc["invocations"]] == ["kvxfer", "nixl"]
