"""``make demo``: serve the embedded model disaggregated, stream one chat answer, stop.

Starts ``kvxfer serve`` (1 prefill + 1 decode worker, each pinned to its own
core when the machine has two), sends one streamed chat request, prints the
answer as it arrives, then TTFT, TPOT and the request's KV transfer (bytes,
milliseconds, as the router reports them in the final SSE chunk), and stops
the server with SIGTERM (it drains).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

QUESTION = "In two sentences, why do LLM servers split prefill and decode?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(client, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvxfer serve exited with code {proc.returncode}")
        try:
            if client.get("/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"kvxfer serve not healthy after {timeout_s:.0f}s")


def _chat(client, question: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start = time.perf_counter()
    times, info, usage = [], {}, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"server error: {chunk['error']['message']}")
            text = chunk["choices"][0]["delta"].get("content")
            if text:
                times.append(time.perf_counter())
                print(text, end="", flush=True)
            info, usage = chunk.get("kvxfer", info), chunk.get("usage", usage)
    print()
    return {"start": start, "times": times, "kvxfer": info, "usage": usage}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxfer.cli.demo", description=__doc__.splitlines()[0])
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "kvxfer.cli", "serve", "--port", str(port),
           "--prefill", "1", "--decode", "1", "--log-level", "warning"]
    if len(os.sched_getaffinity(0)) >= 2:
        cpus = sorted(os.sched_getaffinity(0))[:2]
        cmd += ["--cpus", str(cpus[0]), str(cpus[1])]  # one core each, 1 torch thread each
    print(f"$ kvxfer serve --port {port} --prefill 1 --decode 1 " + " ".join(cmd[cmd.index("--log-level") + 2:]))
    proc = subprocess.Popen(cmd, start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    try:
        _wait_healthy(client, proc, args.startup_timeout)
        print(f"user: {args.question}\nassistant: ", end="", flush=True)
        out = _chat(client, args.question, args.max_tokens)
        transports = sorted({line.split('value="')[1].split('"')[0]
                             for line in client.get("/metrics").text.splitlines()
                             if line.startswith("kvxfer_agent_info") and 'key="transport:' in line})
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    times, info = out["times"], out["kvxfer"]
    ttft_ms = (times[0] - out["start"]) * 1e3 if times else float("nan")
    tpot_ms = (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else float("nan")
    print(f"\nTTFT {ttft_ms:.0f} ms | TPOT {tpot_ms:.1f} ms | "
          f"{out['usage'].get('prompt_tokens')} prompt + {out['usage'].get('completion_tokens')} "
          f"output tokens")
    kv_ms = info.get("kv_transfer_ms")
    print(f"KV transfer {info.get('prefill_worker')} -> {info.get('decode_worker')}: "
          f"{info.get('kv_bytes', 0) / 1e6:.2f} MB in "
          f"{'n/a' if kv_ms is None else f'{kv_ms:.2f} ms'}"
          f"{' (recomputed)' if info.get('recomputed') else ''}"
          f" | transport {', '.join(transports) or 'n/a'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
