"""``kvxfer serve``: the reference prefill/decode server (OpenAI-compatible HTTP)."""
from __future__ import annotations

import argparse
import os

from kvxfer.serving.engine.config import SCHEDULES, EngineConfig

API_KEY_ENV = "KVXFER_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="reference disaggregated server (router + workers)",
                       description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="prefill workers (default 1; with --discovery: local workers to start, default 0)")
    p.add_argument("--decode", type=int, default=None, metavar="M",
                   help="decode workers (default 1; with --discovery: local workers to start, default 0)")
    p.add_argument("--colocated", type=int, default=0, metavar="N",
                   help="N workers that prefill and decode themselves (the baseline)")
    p.add_argument("--model", default=None, metavar="PATH.gguf",
                   help="Llama-family GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cpus", nargs="+", default=(), metavar="LIST",
                   help="CPU group per worker (prefill workers first), e.g. --cpus 0 1; "
                        "one group is shared by all")
    p.add_argument("--threads", type=int, default=None, metavar="T",
                   help="torch threads per worker (default: its CPU group's size)")
    p.add_argument("--on-transfer-failure", choices=("fail", "recompute"), default="recompute")
    p.add_argument("--num-blocks", type=int, default=EngineConfig.num_blocks, help="KV blocks per worker")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--schedule", choices=SCHEDULES, default=EngineConfig.schedule,
                   help="mixed: decode tokens and prompt chunks share each step (chunked "
                        "prefill); separate: prefill steps and decode steps apart")
    p.add_argument("--local-prefill-tokens", type=int, default=0, metavar="N",
                   help="disaggregated: prefill uncached prompts shorter than N tokens on the "
                        "decode worker (0: off)")
    p.add_argument("--local-prefill-queue", type=int, default=0, metavar="K",
                   help="disaggregated: prefill on the decode worker while the prefill worker "
                        "holds K or more requests (0: off)")
    p.add_argument("--transfer-timeout", type=float, default=30.0, metavar="S")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /metrics "
                        f"(default: ${API_KEY_ENV}; prefer the variable: a command line is visible in ps)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="larger request bodies get HTTP 413 (default 1 MiB)")
    p.add_argument("--discovery", default=None, metavar="URL",
                   help="etcd://HOST:PORT[/prefix] or static://HOST:PORT,...: route to workers "
                        "started with `kvxfer worker` (shared secret: $KVXFER_SECRET or --secret-file)")
    p.add_argument("--secret-file", default=None, metavar="PATH")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    from kvxfer.serving.server.serve_config import ServeConfig, parse_cpu_group

    if args.colocated and (args.prefill or args.decode):
        raise SystemExit("kvxfer serve: --colocated excludes --prefill/--decode")
    if args.discovery and args.colocated:
        raise SystemExit("kvxfer serve: --discovery serves prefill/decode workers only")
    default = 0 if args.colocated or args.discovery else 1
    spawned = 0 if args.colocated or args.discovery else None  # discovery: see _local_workers
    return ServeConfig(
        host=args.host, port=args.port, discovery=args.discovery, secret_file=args.secret_file,
        num_prefill=spawned if spawned is not None else (args.prefill or default),
        num_decode=spawned if spawned is not None else (args.decode or default),
        num_colocated=args.colocated, model_path=args.model,
        cpu_groups=tuple(parse_cpu_group(g) for g in args.cpus),
        on_transfer_failure=args.on_transfer_failure, num_threads=args.threads,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        schedule=args.schedule, local_prefill_tokens=args.local_prefill_tokens,
        local_prefill_queue=args.local_prefill_queue,
        transfer_timeout_s=args.transfer_timeout, log_level=args.log_level,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvxfer.serving.server.router import create_app

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"kvxfer serve: {exc}") from None
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s router %(levelname)s %(message)s")
    local = _local_workers(args) if args.discovery else []
    try:
        # uvicorn's SIGTERM/SIGINT handling stops accepting, lets in-flight
        # responses finish (bounded), then runs the lifespan exit: workers drain.
        uvicorn.run(create_app(config), host=config.host, port=config.port,
                    log_level=args.log_level, timeout_graceful_shutdown=int(config.drain_timeout_s))
    finally:
        _stop_local(local, config.drain_timeout_s)
    return 0


def _local_workers(args: argparse.Namespace) -> list:
    """``--discovery`` with ``--prefill N``/``--decode M``: start that many ``kvxfer worker``
    processes on this host; they publish themselves like any other worker (listening on
    ``--host``, or 127.0.0.1 when that is a wildcard) and are found through discovery.
    They share the router's process group and are drained when it exits."""
    import subprocess
    import sys

    from kvxfer.serving.server.serve_config import parse_cpu_group

    roles = ["prefill"] * (args.prefill or 0) + ["decode"] * (args.decode or 0)
    if roles and not (args.secret_file or os.environ.get("KVXFER_SECRET")):
        raise SystemExit("kvxfer serve: set KVXFER_SECRET or --secret-file (shared with the workers)")
    groups = [parse_cpu_group(g) for g in args.cpus]
    if len(groups) not in (0, 1, len(roles)):
        raise SystemExit(f"kvxfer serve: --cpus: give 1 group or one per worker ({len(roles)})")
    host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else args.host
    procs = []
    for i, role in enumerate(roles):
        argv = [sys.executable, "-m", "kvxfer.cli", "worker", "--role", role,
                "--listen", f"{host}:0", "--discovery", args.discovery,
                "--name", f"{role}-{os.uname().nodename}-{os.getpid()}-{i}",
                "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--transfer-timeout", str(args.transfer_timeout),
                "--on-transfer-failure", args.on_transfer_failure, "--log-level", args.log_level]
        for flag, value in (("--model", args.model), ("--secret-file", args.secret_file),
                            ("--threads", args.threads and str(args.threads)),
                            ("--cpus", args.cpus[i if len(groups) > 1 else 0] if groups else None)):
            if value:
                argv += [flag, value]
        procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
    return procs


def _stop_local(procs: list, timeout_s: float) -> None:
    import signal
    import subprocess

    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # drain, withdraw from discovery, exit
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
