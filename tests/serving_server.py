"""Run a real ``kvxfer serve`` (uvicorn + worker processes) for a test module.

Every wait has a timeout; :meth:`Server.stop` always ends the router's whole
process group (router and workers), so a failing test leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

STARTUP_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0


def faults_env(**env: str) -> dict:
    """``env`` plus ``PYTHONPATH`` starting with tests/faults (its sitecustomize patches
    the server's processes: ``KVXFER_FAULT_FILE``, ``KVXFER_PAUSE_FILE``)."""
    faults = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
    return {**env, "PYTHONPATH": os.pathsep.join([faults, os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *serve_args: str, env: dict | None = None, num_blocks: int | None = 256):
        """``num_blocks`` None: the server's own default pool."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvxfer.cli", "serve", "--port", str(self.port),
               "--threads", "1", "--transfer-timeout", "20", "--log-level", "warning",
               *(() if num_blocks is None else ("--num-blocks", str(num_blocks))), *serve_args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        self.client = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvxfer serve exited with {self.proc.returncode}")
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("kvxfer serve did not become healthy")
            time.sleep(0.5)

    def complete(self, prompt, **params) -> dict:
        params.setdefault("temperature", 0)
        r = self.client.post("/v1/completions", json={"prompt": prompt, **params})
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, path: str, body: dict) -> list:
        """The SSE ``data:`` payloads of one streamed request (``"[DONE]"`` kept as a str)."""
        events = []
        with self.client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events

    def health(self) -> dict:
        return self.client.get("/health").json()

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # workers share the router's session: nothing may outlive the test
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
