"""Model-free units of the serving layer: IPC framing, Prometheus text, config, SSE."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from kvxfer.errors import ProtocolError
from kvxfer.serving.channel import ipc
from kvxfer.serving.server.prom import Registry, WorkerSeries
from kvxfer.serving.server.adaptive_policy import AdaptivePolicy
from kvxfer.serving.engine.config import parse_cpu_group
from kvxfer.serving.server.serve_config import ServeConfig
from kvxfer.serving.server.sse import DONE, event


def test_ipc_round_trip_both_ends():
    async def main():
        router_sock, worker_sock = socket.socketpair()
        worker = ipc.WorkerChannel(worker_sock)
        router = await ipc.RouterChannel.open(router_sock)
        router.send({"op": "admit", "rid": "r1", "prompt_ids": list(range(5000))})
        msg = await asyncio.to_thread(worker.inbox.get, True, 5)
        assert msg["prompt_ids"] == list(range(5000))
        worker.send({"ev": "token", "rid": "r1", "token": 7})
        assert await asyncio.wait_for(router.recv(), 5) == {"ev": "token", "rid": "r1", "token": 7}
        worker.close()  # the worker went away: the router sees end of stream
        assert await asyncio.wait_for(router.recv(), 5) is None
        router.close()

    asyncio.run(main())


def test_ipc_worker_sees_eof_and_rejects_garbage():
    a, b = socket.socketpair()
    worker = ipc.WorkerChannel(b)
    a.close()
    assert worker.inbox.get(timeout=5) == {"op": "eof"}
    with pytest.raises(ProtocolError):
        ipc.decode(ipc.IPC_MSG, b"[1, 2]")
    with pytest.raises(ProtocolError):
        ipc.decode(ipc.IPC_MSG, b"{not json")
    with pytest.raises(ProtocolError):  # an agent control frame is not a router/worker message
        ipc.decode(1, b"{}")


def test_prometheus_text():
    reg = Registry()
    h = reg.histogram("lat_seconds", "latency", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    c = reg.counter("bytes_total", "bytes", ("worker",))
    c.inc(10, worker="a")
    c.inc(5, worker="a")
    reg.gauge("up", "alive", ("worker",)).set(1, worker='we"ird')
    with pytest.raises(ValueError):
        c.inc(1, other="x")
    text = reg.render()
    assert 'lat_seconds_bucket{le="0.1"} 2.0' in text
    assert 'lat_seconds_bucket{le="1.0"} 3.0' in text
    assert 'lat_seconds_bucket{le="+Inf"} 4' in text and "lat_seconds_count 4" in text
    assert 'bytes_total{worker="a"} 15' in text
    assert 'up{worker="we\\"ird"} 1' in text
    assert "# TYPE lat_seconds histogram" in text and "# TYPE up gauge" in text
    # each server its own registry: a second one in this process takes the same names
    again = Registry()
    again.counter("bytes_total", "bytes", ("worker",)).inc(1, worker="b")
    assert 'bytes_total{worker="b"} 1' in again.render() and 'worker="a"' not in again.render()
    g = again.gauge("stat", "a worker's stat", ("worker", "stat"))
    g.set(2, worker="b", stat="awaiting_kv")
    g.set(7, worker="b", stat="free_blocks")
    g.remove(worker="b", stat="awaiting_kv")
    g.remove(worker="b", stat="never_set")  # nothing there: nothing to do
    assert 'stat{stat="free_blocks",worker="b"} 7' in again.render()
    assert "awaiting_kv" not in again.render()
    with pytest.raises(ValueError):
        g.remove(worker="b")


def test_worker_series_hold_what_the_present_workers_report():
    reg = Registry()
    series = WorkerSeries(reg)
    series.seen("decode-0", True, 2)
    series.report("decode-0", {"awaiting_kv": 2, "free_blocks": 100}, {"transport": "ucx:tcp"})
    series.seen("w-gone", True, 0)
    series.report("w-gone", {"sending": 1}, {"backend": "ucx"})
    text = reg.render()
    assert 'kvxfer_worker_stat{stat="awaiting_kv",worker="decode-0"} 2' in text
    assert 'kvxfer_agent_info{key="transport",value="ucx:tcp",worker="decode-0"} 1' in text
    # decode-0 switched to prefill (no awaiting_kv now) over another transport; w-gone left
    series.report("decode-0", {"sending": 0, "free_blocks": 100}, {"transport": "vm"})
    series.keep(["decode-0"])
    text = reg.render()
    assert "awaiting_kv" not in text and 'value="ucx:tcp"' not in text
    assert 'kvxfer_worker_stat{stat="sending",worker="decode-0"} 0' in text
    assert 'kvxfer_agent_info{key="transport",value="vm",worker="decode-0"} 1' in text
    assert 'kvxfer_worker_up{worker="decode-0"} 1' in text
    assert "w-gone" not in text


def test_cpu_groups_and_worker_specs():
    assert parse_cpu_group("0-2,5") == (0, 1, 2, 5)
    with pytest.raises(ValueError):
        parse_cpu_group("3-1")
    specs = ServeConfig(num_prefill=1, num_decode=2, cpu_groups=((0,), (1,), (2, 3))).worker_specs()
    assert [(s.name, s.role, s.cpus, s.num_threads) for s in specs] == [
        ("prefill-0", "prefill", (0,), 1), ("decode-0", "decode", (1,), 1),
        ("decode-1", "decode", (2, 3), 2)]
    colocated = ServeConfig(num_prefill=0, num_decode=0, num_colocated=2, cpu_groups=((0, 1),))
    assert [(s.name, s.cpus, s.num_threads) for s in colocated.worker_specs()] == [
        ("colocated-0", (0, 1), 1), ("colocated-1", (0, 1), 1)]
    for bad in (dict(num_colocated=1), dict(num_prefill=0), dict(on_transfer_failure="retry"),
                dict(cpu_groups=((0,), (1,), (2,))), dict(schedule="fifo"),
                dict(local_prefill_tokens=-1), dict(local_prefill_queue=-2),
                dict(prefill_nice=-1), dict(prefill_nice=20), dict(prefill_nice=1.5),
                dict(num_prefill=2, num_decode=1, prefill_nice=5, adaptive=AdaptivePolicy())):
        with pytest.raises(ValueError):
            ServeConfig(**bad)


def test_store_needs_a_secret_and_workers_that_prefill(monkeypatch):
    monkeypatch.delenv("KVXFER_SECRET", raising=False)
    with pytest.raises(ValueError, match="secret"):
        ServeConfig(store="127.0.0.1:7600")
    assert ServeConfig(store="127.0.0.1:7600", secret_file="/run/secret").store == "127.0.0.1:7600"
    monkeypatch.setenv("KVXFER_SECRET", "s" * 16)
    assert ServeConfig(store="etcd://127.0.0.1:2379").store == "etcd://127.0.0.1:2379"
    with pytest.raises(ValueError, match="colocated"):
        ServeConfig(num_prefill=0, num_decode=0, num_colocated=1, store="127.0.0.1:7600")


def test_serve_cli_passes_schedule_and_local_prefill_flags():
    import argparse

    from kvxfer.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--schedule", "separate", "--local-prefill-tokens", "32",
                              "--local-prefill-queue", "3", "--prefill-nice", "7"])
    config = serve.config_from_args(args)
    assert (config.schedule, config.local_prefill_tokens, config.local_prefill_queue,
            config.prefill_nice) == ("separate", 32, 3, 7)


def test_serve_cli_passes_the_connection_limits_to_uvicorn():
    import argparse

    from kvxfer.cli import serve
    from kvxfer.serving.server.http_limits import uvicorn_options
    from kvxfer.serving.server.serve_config import ServeConfig

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    config = serve.config_from_args(parser.parse_args(
        ["serve", "--header-timeout", "3", "--body-timeout", "4.5", "--keep-alive-timeout", "2",
         "--limit-concurrency", "64", "--max-connections-per-source", "8"]))
    opts = uvicorn_options(config)
    # uvicorn's own limit (503 to everything) is off: kvxfer's admission and HTTPGuard bound them
    assert (opts["timeout_keep_alive"], opts["limit_concurrency"]) == (2.0, None)
    admission = opts["http"].admission
    assert (admission.max_connections, admission.max_per_source) == (64, 8)
    assert opts["http"].__name__.startswith("HeaderDeadline")
    assert (config.header_timeout_s, config.body_timeout_s) == (3.0, 4.5)
    defaults = uvicorn_options(ServeConfig(), fd_limit=200)
    assert defaults["timeout_keep_alive"] == 5.0
    assert (defaults["http"].admission.max_connections, defaults["http"].admission.max_per_source) == (136, 64)
    for bad in (dict(header_timeout_s=0), dict(body_timeout_s=float("inf")),
                dict(keep_alive_timeout_s=float("nan")), dict(header_timeout_s=True),
                dict(limit_concurrency=0), dict(limit_concurrency=1.5), dict(max_connections_per_source=0)):
        with pytest.raises(ValueError):
            ServeConfig(**bad)


def test_sse_event_format():
    assert event({"a": 1}) == 'data: {"a":1}\n\n'
    assert DONE == "data: [DONE]\n\n"
    assert json.loads(event({"t": "é\n"})[6:]) == {"t": "é\n"}


def test_request_schema_defaults_and_limits():
    from pydantic import ValidationError

    from kvxfer.serving.server.api import ChatRequest, CompletionRequest

    req = CompletionRequest(prompt="hi")
    assert req.stop == [] and req.sampling([2])["stop_token_ids"] == [2]
    assert req.sampling([])["logprobs"] is None and req.prompts() == ["hi"]
    seeded = CompletionRequest(prompt=[[1, 2], [3]], n=2, seed=7, logprobs=0)
    assert [seeded.sampling([], i)["seed"] for i in range(2)] == [7, 8]
    assert seeded.prompts() == [[1, 2], [3]] and seeded.sampling([])["logprobs"] == 0
    assert ChatRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                       logprobs=True).messages[0].content == "ab"
    assert CompletionRequest(prompt="hi", stop="x").stop == ["x"]
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="hi", top_p=0)
    with pytest.raises(ValidationError):
        ChatRequest(messages=[{"role": "robot", "content": "x"}])


def test_worker_command_line_carries_the_matmul_dtype():
    import argparse

    from kvxfer.cli.worker import add_parser, worker_argv
    from kvxfer.serving.workers.main import parse_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["worker", "--role", "decode", "--listen", "127.0.0.1:0",
                              "--matmul-dtype", "fp32"])
    argv = worker_argv(args)
    assert argv[argv.index("--matmul-dtype") + 1] == "fp32"
    assert parse_args(argv).matmul_dtype == "fp32"
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--role", "decode", "--listen", "127.0.0.1:0",
                           "--matmul-dtype", "int8"])


def test_store_secret_is_the_deployments_and_leaves_the_agents_alone(monkeypatch, tmp_path):
    from kvxfer.serving.channel.ipc import AGENT_SECRET_ENV
    from kvxfer.serving.workers.main import worker_secret

    monkeypatch.setenv(AGENT_SECRET_ENV, (b"a" * 32).hex())  # kvxfer serve's per-server agent secret
    monkeypatch.setenv("KVXFER_SECRET", "d" * 20)
    assert worker_secret(for_store=True) == b"d" * 20  # the nodes' secret, not the agents'
    assert worker_secret() == b"a" * 32  # the agents' own call still finds theirs (and takes it)
    monkeypatch.delenv(AGENT_SECRET_ENV, raising=False)
    assert worker_secret(for_store=True) == b"d" * 20 and worker_secret() == b"d" * 20  # kvxfer worker: one secret
    path = tmp_path / "secret"
    path.write_bytes(b"f" * 24 + b"\n")
    assert worker_secret(str(path), for_store=True) == b"f" * 24
    with pytest.raises(ValueError):
        worker_secret(for_store=True)  # $KVXFER_SECRET was taken by the agents' call, no file
