"""``kvxfer worker``: one prefill or decode worker on any host, found through discovery.

``kvxfer worker --role decode --listen 10.0.0.7:9000 --discovery etcd://10.0.0.2:2379``
loads the model, starts its agent (on the ``--listen`` host, any port), listens
for routers on ``--listen`` and publishes itself under a lease (``--ttl``). The
shared secret comes from ``KVXFER_SECRET`` or ``--secret-file`` (never from the
command line, never stored in etcd). SIGTERM or Ctrl-C: finish what it holds,
withdraw, exit.
"""
from __future__ import annotations

import argparse
import os
import socket

from kvxfer.serving.engine.config import EngineConfig
from kvxfer.cli.serve import add_engine_args
from kvxfer.serving.model.config import MATMUL_DTYPES


def add_parser(sub) -> None:
    p = sub.add_parser("worker", help="one prefill/decode worker for a router on another host",
                       description=__doc__)
    p.add_argument("--role", required=True, choices=("prefill", "decode"))
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="control address for routers (port 0: any free port)")
    p.add_argument("--discovery", default=None, metavar="URL",
                   help="etcd://HOST:PORT[/prefix] (without it, give the router this --listen "
                        "address: kvxfer serve --discovery static://HOST:PORT,...)")
    p.add_argument("--name", default=None, help="unique name (default ROLE-HOSTNAME-PID)")
    p.add_argument("--agent-listen", default=None, metavar="HOST:PORT")
    p.add_argument("--ttl", type=float, default=5.0, metavar="S",
                   help="discovery lease: a dead worker leaves rotation within S seconds")
    p.add_argument("--secret-file", default=None, metavar="PATH")
    p.add_argument("--store", default=None, metavar="URL|NODES",
                   help="the KV pool prefill workers read and fill: etcd://HOST:PORT[/prefix] or "
                        "HOST:PORT,... (store nodes; secret: $KVXFER_SECRET or --secret-file)")
    p.add_argument("--model", default=None, metavar="PATH.gguf")
    p.add_argument("--cpus", default=None, metavar="LIST", help="pin to these CPUs, e.g. 0-3")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: CPUs pinned)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default 1024; --engine sim: the profile's KV capacity at --tp)")
    p.add_argument("--tp", type=int, default=1, metavar="K",
                   help="--engine sim: the tensor-parallel degree the worker models")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default=EngineConfig.matmul_dtype,
                   help="projection dtype: auto (bf16 where the CPU has AMX, else fp32), fp32 "
                        "or bf16; must resolve to the same as the workers it exchanges KV with")
    p.add_argument("--transfer-timeout", type=float, default=30.0, metavar="S")
    add_engine_args(p)
    p.add_argument("--on-transfer-failure", choices=("fail", "recompute"), default="recompute")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The worker process's arguments (kvxfer.serving.workers.main)."""
    from kvxfer.serving.engine.config import parse_cpu_group

    name = args.name or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    cpus = parse_cpu_group(args.cpus) if args.cpus else None
    threads = args.threads or (len(cpus) if cpus else max(1, os.cpu_count() or 1))
    argv = ["--name", name, "--role", args.role, "--listen", args.listen,
            "--threads", str(threads), "--tp", str(args.tp),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--matmul-dtype", args.matmul_dtype,
            "--transfer-timeout", str(args.transfer_timeout),
            "--on-transfer-failure", args.on_transfer_failure, "--ttl", str(args.ttl),
            "--log-level", args.log_level, "--engine", args.engine]
    for flag, value in (("--num-blocks", args.num_blocks and str(args.num_blocks)),
                        ("--discovery", args.discovery), ("--agent-listen", args.agent_listen),
                        ("--secret-file", args.secret_file), ("--model", args.model),
                        ("--cpus", args.cpus), ("--store", args.store), ("--profile", args.profile),
                        ("--sim-kv-scale", args.sim_kv_scale and str(args.sim_kv_scale)),
                        ("--step-log", args.step_log)):
        if value:
            argv += [flag, value]
    return argv


def run(args: argparse.Namespace) -> int:
    from kvxfer.serving.workers.main import main

    try:
        argv = worker_argv(args)
    except ValueError as exc:
        raise SystemExit(f"kvxfer worker: {exc}") from None
    return main(argv)
