"""kvxfer loadgen: trace parsing, prefix-sharing prompts, metrics, and a real run
against a tiny fake OpenAI SSE server (uvicorn on loopback)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi import Request  # noqa: E402  (module level: the endpoint's annotation resolves here)

from kvxfer.loadgen.client import RequestResult, stream_completion
from kvxfer.loadgen.metrics import SLO, summarize_run
from kvxfer.loadgen.poisson import poisson_requests
from kvxfer.loadgen.prompts import PromptBuilder
from kvxfer.loadgen.trace import TraceRequest, jitter, read_trace

TRACE_LINES = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 1030, "output_length": 3, "hash_ids": [0, 1, 5]},
    {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
]


@pytest.fixture()
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in TRACE_LINES))
    return path


def test_read_trace_rebases_and_slices(trace_file, tmp_path):
    reqs = read_trace(trace_file)
    assert [r.timestamp_ms for r in reqs] == [0.0, 0.0, 500.0]
    assert reqs[0].hash_ids == (0, 1, 2) and reqs[2].output_length == 5
    tail = read_trace(trace_file, start=1, max_requests=1)
    assert len(tail) == 1 and tail[0].input_length == 1030 and tail[0].timestamp_ms == 0.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace(bad)


def test_jitter_spreads_each_arrival_within_its_window(trace_file):
    reqs = read_trace(trace_file) * 20  # 60 requests at 0, 0, 500 ms
    moved = jitter(reqs, 3000.0, seed=7)
    times = [r.timestamp_ms for r in moved]
    assert times == sorted(times) and len(moved) == len(reqs)
    assert all(0.0 <= t < 3500.0 for t in times) and len(set(times)) == len(times)
    assert sorted(r.input_length for r in moved) == sorted(r.input_length for r in reqs)
    assert [r.timestamp_ms for r in jitter(reqs, 3000.0, seed=7)] == times  # seeded
    assert [r.timestamp_ms for r in jitter(reqs, 3000.0, seed=8)] != times
    late = jitter(reqs[2:3], 10.0, seed=1)
    assert 500.0 <= late[0].timestamp_ms < 510.0
    assert jitter(reqs, 0.0) == sorted(reqs, key=lambda r: r.timestamp_ms)
    with pytest.raises(ValueError, match="jitter"):
        jitter(reqs, -1.0)
    with pytest.raises(ValueError, match="jitter"):
        jitter(reqs, float("nan"))


def test_shared_hash_ids_share_prefix_exactly(trace_file):
    a, b, c = read_trace(trace_file)
    pb = PromptBuilder(length_scale=0.05, seed=3)
    block = pb.block_words
    wa, wb, wc = (pb.prompt(r).split(" ") for r in (a, b, c))
    assert len(wa) == round(1100 * 0.05) and len(wb) == round(1030 * 0.05)
    assert wa[: 2 * block] == wb[: 2 * block]           # ids 0, 1 shared
    assert wa[2 * block:] != wb[2 * block: len(wa)]     # ids 2 vs 5 differ
    assert wa[:block] != wc[:block]                      # no shared id
    assert PromptBuilder(length_scale=0.05, seed=3).prompt(a) == pb.prompt(a)  # deterministic
    assert PromptBuilder(length_scale=0.05, seed=4).prompt(a) != pb.prompt(a)
    assert pb.max_tokens(a) == 1  # round(4 * 0.05) clamps to one token
    longer = PromptBuilder(length_scale=0.05, seed=3, output_scale=2.0)
    assert longer.max_tokens(a) == 8 and longer.prompt(a) == pb.prompt(a)
    with pytest.raises(ValueError, match="output_scale"):
        PromptBuilder(length_scale=0.05, output_scale=0.0)


def test_poisson_requests():
    reqs = poisson_requests(rate=10, num_requests=20, input_length=1200, output_length=8,
                            spread=0.2, shared_blocks=1, seed=1)
    assert len(reqs) == 20
    assert all(x.timestamp_ms <= y.timestamp_ms for x, y in zip(reqs, reqs[1:]))
    assert all(r.hash_ids[0] == 0 for r in reqs)
    own = [h for r in reqs for h in r.hash_ids[1:]]
    assert len(own) == len(set(own))  # unshared blocks are unique
    with pytest.raises(ValueError):
        poisson_requests(rate=0, num_requests=1, input_length=1, output_length=1)


def test_phased_requests_shift_the_mix():
    from kvxfer.loadgen.poisson import parse_phases, phased_requests

    phases = parse_phases("4:400:4,5:32:48:2", rate=1.0)
    assert phases == [(4, 400, 4, 1.0), (5, 32, 48, 2.0)]
    reqs = phased_requests(phases, seed=3)
    assert [(r.input_length, r.output_length) for r in reqs] == [(400, 4)] * 4 + [(32, 48)] * 5
    assert all(x.timestamp_ms < y.timestamp_ms for x, y in zip(reqs, reqs[1:]))
    ids = [h for r in reqs for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # no accidental prefix sharing across phases
    for bad in ("4:400", "a:1:2", ""):
        with pytest.raises(ValueError):
            parse_phases(bad, rate=1.0)


def _rec(ttft, e2e, tokens, kv_ms=None, sent=0.0, ok=True):
    r = RequestResult(index=0, scheduled_s=sent, sent_s=sent, ttft_s=ttft, e2e_s=e2e,
                      output_tokens=tokens, kv_transfer_ms=kv_ms,
                      chunk_times_s=[ttft + 0.1 * i for i in range(tokens)])
    if not ok:
        r.error = "boom"
    return r.as_dict()


def test_metrics_tpot_goodput_and_kv_share():
    recs = [_rec(0.1, 1.0, 10, kv_ms=5.0),            # tpot 0.1 s, kv 5% of ttft
            _rec(0.5, 0.5, 1, sent=1.0),               # one token: no tpot, meets tpot SLO
            _rec(0.2, 2.0, 10, sent=1.0, ok=False)]
    s = summarize_run(recs, SLO.parse("300,150"))
    assert s["num_ok"] == 2 and s["num_errors"] == 1
    assert s["tpot_ms"]["median"] == pytest.approx(100.0)
    assert s["kv_share_of_ttft_pct"]["median"] == pytest.approx(5.0)
    assert s["duration_s"] == pytest.approx(1.5)
    assert s["goodput"] == pytest.approx(1 / 1.5)     # only the first meets TTFT<=300 ms
    assert s["itl_ms"]["median"] == pytest.approx(100.0)
    with pytest.raises(ValueError):
        SLO.parse("300")


# ---- a fake OpenAI streaming server -------------------------------------------------------

def _fake_app(seen: list):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if body["prompt"].startswith("FAIL"):
            return JSONResponse({"error": {"message": "nope"}}, status_code=500)
        n = body["max_tokens"]

        async def events():
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n},
                    "kvxfer": {"kv_transfer_ms": 0.25, "kv_bytes": 4096}}
            yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture()
def fake_server():
    import uvicorn

    seen: list = []
    config = uvicorn.Config(_fake_app(seen), host="127.0.0.1", port=0, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=10)


def test_loadgen_cli_against_fake_server(fake_server, trace_file, tmp_path):
    from kvxfer.cli import main

    url, seen = fake_server
    out = tmp_path / "run.json"
    rc = main(["loadgen", "--url", url, "--trace", str(trace_file), "--length-scale", "0.05",
               "--time-scale", "0.01", "--slo", "5000,1000", "--label", "fake", "--json", str(out),
               "--no-progress", "--request-timeout", "20"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "loadgen" and doc["label"] == "fake"
    assert {"cpu_model", "num_cores", "git_commit", "load_average"} <= set(doc["environment"])
    recs = doc["requests"]
    assert len(recs) == 3 and all(r["ok"] for r in recs)
    for rec, body in zip(sorted(recs, key=lambda r: r["index"]), sorted(seen, key=lambda b: b["seed"])):
        assert rec["output_tokens"] == body["max_tokens"] == len(rec["chunk_times_s"])
        assert 0 < rec["ttft_s"] <= rec["e2e_s"] and rec["kv_transfer_ms"] == 0.25
        assert body["stream"] is True
    assert doc["summary"]["kv_share_of_ttft_pct"]["count"] == 3
    assert doc["summary"]["goodput"] > 0

    png = tmp_path / "cdf.png"
    assert main(["loadgen", "--results", str(out), str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_client_records_http_error(fake_server):
    import httpx

    url, _ = fake_server

    async def go():
        res = RequestResult(index=0, scheduled_s=0.0)
        async with httpx.AsyncClient() as client:
            await stream_completion(client, url + "/v1/completions",
                                    {"prompt": "FAIL please", "max_tokens": 2}, res, timeout=10)
        return res

    res = asyncio.run(go())
    assert not res.ok and res.error.startswith("HTTP 500")


def test_unreachable_server_is_an_error_not_a_hang(tmp_path):
    from kvxfer.loadgen.runner import RunConfig, run

    reqs = [TraceRequest(0.0, 10, 2, (0,))]
    res = run(reqs, PromptBuilder(length_scale=1.0), RunConfig(url="http://127.0.0.1:9", request_timeout=5))
    assert len(res) == 1 and not res[0].ok and "Connect" in res[0].error


def test_slo_auto_calibrates_on_single_requests(fake_server, trace_file, tmp_path, capsys):
    from kvxfer.cli import main
    from kvxfer.loadgen.calibrate import parse_factors, representative

    url, seen = fake_server
    reqs = read_trace(trace_file)
    assert representative(reqs).input_length == 1030 and representative(reqs).output_length == 4
    with pytest.raises(ValueError):
        parse_factors("0.5,2")  # an SLO below single-request latency is unmeetable
    out = tmp_path / "run.json"
    rc = main(["loadgen", "--url", url, "--trace", str(trace_file), "--length-scale", "0.05",
               "--time-scale", "0.01", "--slo", "auto", "--calibrate-repeats", "2",
               "--slo-factors", "3,2", "--json", str(out), "--no-progress",
               "--request-timeout", "20"])
    assert rc == 0
    assert len(seen) == 2 + 3  # two single requests first, then the run
    doc = json.loads(out.read_text())
    cal = doc["calibration"]
    assert cal["single_ttft_ms"] > 0 and cal["single_tpot_ms"] > 0
    assert cal["slo"]["ttft_ms"] == round(3 * cal["single_ttft_ms"])
    assert cal["slo"]["tpot_ms"] == round(2 * cal["single_tpot_ms"])
    assert doc["summary"]["slo"] == cal["slo"]
    assert "reuse with --slo" in capsys.readouterr().out
    # two saved runs compared: ratios against the first
    assert main(["loadgen", "--results", str(out), str(out), "--slo", "5000,1000"]) == 0
    assert "goodput 1.00x" in capsys.readouterr().out
