"""``make demo-vllm``: SmolLM2 exported to HF format, ``vllm serve`` P and D with
KVXferConnector, the kvxfer proxy in front, one chat answer streamed through the
``openai`` client, everything stopped. Run: ``python -m kvxfer.integrations.vllm.demo``.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ...secrets import SECRET_ENV, load_secret

START_TIMEOUT_S = 900.0
# Two engines on a small CPU: one OpenMP thread each, unbound (vLLM CPU's default binds
# every engine's threads to the same cores, and they spin against each other).
# Set these variables yourself to override.
SMALL_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_serve_cmd(model: str, port: int, role: str, *, dtype: str = "float32") -> list:
    """``vllm serve`` (as its api_server module) with KVXferConnector in ``role``
    (``kv_producer`` | ``kv_consumer``); the secret comes from ``$KVXFER_SECRET``."""
    config = {"kv_connector": "KVXferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
              "kv_role": role, "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"listen": "127.0.0.1:0"}}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--block-size", "32",
            "--max-model-len", "4096", "--enforce-eager", "--enable-prefix-caching",
            "--kv-transfer-config", json.dumps(config)]


def _wait(url: str, procs: list, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a demo process exited early; see the logs above")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} did not come up in {START_TIMEOUT_S:.0f} s")


def main() -> int:
    from openai import OpenAI

    from ..hf_export import export_hf

    work = tempfile.mkdtemp(prefix="kvxfer-vllm-demo-")
    model = export_hf(os.path.join(work, "smollm2-hf"), dtype="float32")
    print(f"exported SmolLM2-135M-Instruct to {model}", flush=True)
    secret = load_secret(default=secrets.token_hex(16)).decode()  # $KVXFER_SECRET, else a fresh one
    env = dict(os.environ, **{SECRET_ENV: secret},
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    for key, value in SMALL_CPU_ENV.items():
        env.setdefault(key, value)
    p_port, d_port, proxy_port = _port(), _port(), _port()
    logs, procs = [], []
    try:
        for name, cmd in (("prefill", vllm_serve_cmd(model, p_port, "kv_producer")),
                          ("decode", vllm_serve_cmd(model, d_port, "kv_consumer")),
                          ("proxy", [sys.executable, "-m", "kvxfer.cli", "proxy", "--port", str(proxy_port),
                                     "--prefill", f"http://127.0.0.1:{p_port}",
                                     "--decode", f"http://127.0.0.1:{d_port}"])):
            log = open(os.path.join(work, f"{name}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            print(f"started {name} (log: {log.name})", flush=True)
        print("waiting for the engines (minutes on a small CPU) ...", flush=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        for port in (p_port, d_port, proxy_port):
            _wait(f"http://127.0.0.1:{port}", procs, deadline)
        client = OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="none", timeout=300.0)
        question = "What is the capital of France? Answer in one sentence."
        print(f"\nuser: {question}\nassistant: ", end="", flush=True)
        stream = client.chat.completions.create(model=model, stream=True, temperature=0, max_tokens=48,
                                                messages=[{"role": "user", "content": question}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print("\n\n(prefilled on P, KV moved by kvxfer, decoded on D)")
        with open(logs[1].name, errors="replace") as f:
            loaded = [line.strip() for line in f if "kvxfer: loaded" in line]
        print("D's connector: " + (loaded[-1] if loaded else "no load logged (D recomputed the prompt)"))
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        for log in logs:
            log.close()
        shutil.rmtree(model, ignore_errors=True)  # ~0.5 GB; the logs stay in the work dir


if __name__ == "__main__":
    sys.exit(main())
