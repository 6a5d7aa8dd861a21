"""Adaptive P/D rebalancing end to end: a load shifting from prompt-heavy to decode-heavy.

Real processes, real HTTP, the real model: ``kvxfer serve --prefill 1 --decode 2
--adaptive`` with small thresholds. The test hook ``KVXFER_PAUSE_FILE``
(tests/faults/sitecustomize.py) holds a worker's model steps while a file
exists, so each phase's queue is there when the router looks, whatever the
machine's speed (no timing assumptions):

1. prompt-heavy: prefill-0 paused, prompts pile up for it -> a decode worker is
   drained (its requests finish once prefill-0 resumes) and becomes a prefill worker;
2. decode-heavy: the remaining decode worker paused, requests past token 0 pile
   up on it -> a prefill worker is drained and becomes a decode worker.

Every answer, before, during and after the switches, equals colocated token for
token; every pool is whole at the end.
"""
from __future__ import annotations

import re
import threading

import pytest
from serving_server import Server, faults_env
from waiting import until

pytestmark = pytest.mark.slow

WAIT_S = 240.0
BASE = "Once upon a time in a quiet town by the sea, a young sailor named"
PROMPT_HEAVY = [f"{BASE} {name} found an old map that" for name in
                ("Anna", "Ben", "Clara", "David", "Eva", "Felix")]
DECODE_HEAVY = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(6)]
PROMPT_TOKENS, DECODE_TOKENS = 2, 12


def _until(predicate, what: str, timeout: float = WAIT_S):
    return until(predicate, what, timeout, interval=0.2)


def _changes(server) -> dict[tuple[str, str, str], int]:
    text = server.client.get("/metrics").text
    return {(m[0], m[1], m[2]): int(m[3]) for m in re.findall(
        r'kvxfer_role_changes_total\{from="(\w+)",reason="(\w+)",to="(\w+)"\} (\d+)', text)}


def _in_threads(server, prompts, max_tokens) -> tuple[list, list[threading.Thread]]:
    results: list = [None] * len(prompts)

    def one(i):
        results[i] = server.complete(prompts[i], max_tokens=max_tokens)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return results, threads


def _roles(server) -> dict[str, str]:
    return {w["name"]: w["role"] for w in server.health()["workers"]}


@pytest.fixture(scope="module")
def reference():
    server = Server("--colocated", "1")
    try:
        return {p: server.complete(p, max_tokens=n)["kvxfer"]["token_ids"]
                for prompts, n in ((PROMPT_HEAVY, PROMPT_TOKENS), (DECODE_HEAVY, DECODE_TOKENS))
                for p in prompts}
    finally:
        server.stop()


def test_shifting_mix_moves_workers_and_answers_equal_colocated(reference, tmp_path):
    pause = tmp_path / "pause"
    server = Server("--prefill", "1", "--decode", "2", "--adaptive",
                    "--adaptive-interval", "0.25", "--adaptive-dwell", "1",
                    "--adaptive-sustain", "2", "--adaptive-prefill-queue", "1,3",
                    "--adaptive-decode-active", "1,3",
                    env=faults_env(KVXFER_PAUSE_FILE=str(pause)))
    try:
        metrics = server.client.get("/metrics").text
        assert 'kvxfer_workers{role="prefill"} 1' in metrics
        assert 'kvxfer_workers{role="decode"} 2' in metrics

        # 1. prompt-heavy: six prompts wait for the one (paused) prefill worker
        held = tmp_path / "pause-prefill-0"
        held.touch()
        results, threads = _in_threads(server, PROMPT_HEAVY, PROMPT_TOKENS)
        switching = _until(lambda: [w for w in server.health()["workers"] if w["switching"]],
                           "worker draining for a role change")
        assert switching[0]["role"] == "decode"
        held.unlink()  # its requests finish, then it switches
        _until(lambda: _changes(server).get(("decode", "prefill_queue", "prefill")) == 1,
               "decode -> prefill change")
        for t in threads:
            t.join(WAIT_S)
        for prompt, got in zip(PROMPT_HEAVY, results):
            assert got["kvxfer"]["token_ids"] == reference[prompt], prompt
        roles = _roles(server)
        assert sorted(roles.values()) == ["decode", "prefill", "prefill"]
        assert roles[switching[0]["name"]] == "prefill"

        # 2. decode-heavy: requests past token 0 pile up on the one (paused) decode worker
        [decoder] = [n for n, r in roles.items() if r == "decode"]
        held = tmp_path / f"pause-{decoder}"
        held.touch()
        results, threads = _in_threads(server, DECODE_HEAVY, DECODE_TOKENS)
        _until(lambda: _changes(server).get(("prefill", "decode_batch", "decode")) == 1,
               "prefill -> decode change")
        held.unlink()
        for t in threads:
            t.join(WAIT_S)
        for prompt, got in zip(DECODE_HEAVY, results):
            assert got["kvxfer"]["token_ids"] == reference[prompt], prompt
        assert sorted(_roles(server).values()) == ["decode", "decode", "prefill"]

        # 3. after both changes: every request still equals colocated, one at a time
        for prompt in PROMPT_HEAVY[:2] + DECODE_HEAVY[:2]:
            n = PROMPT_TOKENS if prompt in PROMPT_HEAVY else DECODE_TOKENS
            assert server.complete(prompt, max_tokens=n)["kvxfer"]["token_ids"] == reference[prompt]
        assert _changes(server) == {("decode", "prefill_queue", "prefill"): 1,
                                    ("prefill", "decode_batch", "decode"): 1}
        metrics = server.client.get("/metrics").text
        assert 'kvxfer_workers{role="prefill"} 1' in metrics
        assert 'kvxfer_workers{role="decode"} 2' in metrics
        free = re.findall(r'kvxfer_worker_stat\{stat="free_blocks",worker="[\w-]+"\} (\d+)', metrics)
        assert free == ["256"] * 3  # every block of every pool back (serving_server: 256 each)
        # each worker's gauges are its present role's: none left over from the role it had
        roles = _roles(server)
        for name, role in roles.items():
            stats = set(re.findall(rf'kvxfer_worker_stat\{{stat="(\w+)",worker="{name}"\}}', metrics))
            assert ("awaiting_kv" in stats) == (role == "decode"), (name, role, stats)
            assert ("sending" in stats) == (role == "prefill"), (name, role, stats)
        assert server.health()["status"] == "ok"
    finally:
        server.stop()
