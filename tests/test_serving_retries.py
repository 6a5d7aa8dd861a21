"""A request whose worker dies is placed again (``--retries``) if no token went out yet.

Real processes: ``kvxfer serve --colocated 2 --retries 1`` and a disaggregated
``--prefill 2 --decode 1 --retries 1``; workers are killed with SIGKILL. The
``KVXFER_PAUSE_FILE`` hook (tests/faults) holds the workers' model steps, so the kill lands
before token 0 (or after it) by construction, not by timing.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading

import pytest
from serving_server import Server, faults_env
from waiting import until as _until

pytestmark = pytest.mark.slow

PROMPT = "The old lighthouse keeper climbed the stairs every evening to"
MAX_TOKENS = 6


def _holder(server, role: str) -> dict:
    """The live worker of ``role`` holding a request."""
    return _until(lambda: next((w for w in server.health()["workers"] if w["role"] == role
                                and w["alive"] and w["inflight"] > 0), None),
                  f"{role} worker holding the request")


def _retries(server, role: str) -> int:
    m = re.search(rf'kvxfer_request_retries_total\{{role="{role}"\}} (\d+)',
                  server.client.get("/metrics").text)
    return int(m.group(1)) if m else 0


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    pause = tmp_path_factory.mktemp("hook") / "pause"
    server = Server("--colocated", "2", "--retries", "1", env=faults_env(KVXFER_PAUSE_FILE=str(pause)))
    server.pause = pause
    try:
        yield server
    finally:
        server.stop()


def test_worker_killed_before_token_0_request_retried_on_the_other(colocated):
    server = colocated
    reference = server.complete(PROMPT, max_tokens=MAX_TOKENS)["kvxfer"]["token_ids"]
    server.pause.touch()  # every worker admits but computes nothing
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=server.complete(PROMPT, max_tokens=MAX_TOKENS)),
                         daemon=True)
    t.start()
    try:
        victim = _holder(server, "colocated")
        os.kill(victim["pid"], signal.SIGKILL)
        # the retry lands on the other worker (still paused: nothing can have streamed)
        _until(lambda: any(w["inflight"] and w["name"] != victim["name"]
                           for w in server.health()["workers"]), "request on the other worker")
    finally:
        server.pause.unlink()
    t.join(120)
    got = out["r"]["kvxfer"]
    assert got["token_ids"] == reference
    assert got["decode_worker"] != victim["name"]
    assert _retries(server, "colocated") == 1
    _until(lambda: server.health()["status"] == "ok", "killed worker restarted")


def test_worker_killed_after_a_token_stream_ends_with_an_error(colocated):
    server = colocated
    before = _retries(server, "colocated")
    events = []
    with server.client.stream("POST", "/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                                    "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break  # a token is out: hold the worker, then kill it
        server.pause.touch()
        try:
            victim = _holder(server, "colocated")
            os.kill(victim["pid"], signal.SIGKILL)
            events += [line[6:] for line in lines if line.startswith("data: ")]
        finally:
            server.pause.unlink()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "error" in error and "died" in error["error"]["message"]
    assert _retries(server, "colocated") == before  # a streamed request is never retried
    _until(lambda: server.health()["status"] == "ok", "killed worker restarted")


def test_prefill_worker_killed_before_token_0_retried_on_another_prefill_worker(tmp_path):
    pause = tmp_path / "pause"
    server = Server("--prefill", "2", "--decode", "1", "--retries", "1",
                    env=faults_env(KVXFER_PAUSE_FILE=str(pause)))
    try:
        reference = server.complete(PROMPT, max_tokens=MAX_TOKENS)["kvxfer"]["token_ids"]
        held = [tmp_path / "pause-prefill-0", tmp_path / "pause-prefill-1"]
        for f in held:
            f.touch()
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=server.complete(PROMPT, max_tokens=MAX_TOKENS)),
                             daemon=True)
        t.start()
        try:
            victim = _holder(server, "prefill")
            os.kill(victim["pid"], signal.SIGKILL)
            _until(lambda: any(w["role"] == "prefill" and w["inflight"] and w["name"] != victim["name"]
                               for w in server.health()["workers"]), "request on the other prefill worker")
        finally:
            for f in held:
                f.unlink()
        t.join(120)
        got = out["r"]["kvxfer"]
        assert got["token_ids"] == reference
        assert got["prefill_worker"] not in (None, victim["name"]) and got["kv_bytes"] > 0
        assert _retries(server, "prefill") == 1
        # the abandoned attempt's blocks come back once the agent releases its recv
        _until(lambda: re.search(r'kvxfer_worker_stat\{stat="free_blocks",worker="decode-0"\} 256(\.0)?\n',
                                 server.client.get("/metrics").text), "decode-0 pool whole again")
    finally:
        server.stop()
