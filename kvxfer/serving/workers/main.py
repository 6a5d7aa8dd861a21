"""Worker process entry: ``python -m kvxfer.serving.workers --role R --ipc-fd FD ...``.

Order matters: pin CPUs and size torch's thread pool before the model loads
(the pool is created on first use), then load the model, create and register
the agent, and only then report ``ready`` with the agent's address.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import sys

SECRET_ENV = "KVXFER_AGENT_SECRET"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvxfer.serving.workers")
    p.add_argument("--name", required=True)
    p.add_argument("--role", required=True, choices=("prefill", "decode", "colocated"))
    p.add_argument("--ipc-fd", type=int, required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--cpus", default=None, help="CPU list to pin to, e.g. 0 or 2-3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--schedule", choices=("mixed", "separate"), default="mixed")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--on-transfer-failure", choices=("fail", "recompute"), default="recompute")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def _pin(cpus: str | None, num_threads: int) -> None:
    import torch

    from ..serve_config import parse_cpu_group

    if cpus:
        os.sched_setaffinity(0, parse_cpu_group(cpus))
    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (a pool started): harmless
        pass


def _make_agent(name: str, runtime, lease_timeout_s: float, released: queue.SimpleQueue):
    import kvxfer

    secret_hex = os.environ.pop(SECRET_ENV, None)  # not inherited by anything we start
    if not secret_hex:
        raise RuntimeError(f"{SECRET_ENV} is not set; workers are started by `kvxfer serve`")
    agent = kvxfer.Agent(name, listen="127.0.0.1:0", secret=bytes.fromhex(secret_hex),
                         lease_timeout=lease_timeout_s,
                         on_release=lambda request_id, block_ids, reason: released.put(request_id))
    agent.register_kv(runtime.cache.kv_layout())
    return agent


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    from ..ipc import WorkerChannel

    channel = WorkerChannel.from_fd(args.ipc_fd)
    agent = None
    try:
        _pin(args.cpus, args.threads)
        from ..config import EngineConfig
        from .loop import WorkerContext
        from .runtime import Runtime

        config = EngineConfig(model_path=args.model, num_blocks=args.num_blocks,
                              max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              schedule=args.schedule,
                              num_threads=args.threads)
        runtime = Runtime.load(config)
        released: queue.SimpleQueue = queue.SimpleQueue()
        if args.role != "colocated":
            agent = _make_agent(args.name, runtime, args.transfer_timeout, released)
        ctx = WorkerContext(args.name, args.role, channel, runtime, agent,
                            args.transfer_timeout, args.on_transfer_failure, released,
                            args.request_timeout)
        if args.role == "prefill":
            from .prefill import PrefillWorker as Role
        else:
            from .decode import DecodeWorker as Role
        worker = Role(ctx)
    except Exception as exc:
        logging.exception("startup failed")
        channel.send({"ev": "start_failed", "error": f"{type(exc).__name__}: {exc}"})
        if agent is not None:
            agent.close()
        return 1
    channel.send({"ev": "ready", "name": args.name, "role": args.role, "pid": os.getpid(),
                  "agent_address": agent.address if agent is not None else None,
                  "transport": _transport(agent),
                  "num_blocks": config.num_blocks, "block_size": config.block_size,
                  "threads": args.threads,
                  "cpus": sorted(os.sched_getaffinity(0))})
    try:
        return worker.run()
    finally:
        if agent is not None:
            agent.close()
        channel.close()


def _transport(agent) -> str | None:
    """The agent's backend (per-peer transports appear in its metrics once connected)."""
    return None if agent is None else agent.metrics.info.get("backend")
