"""Worker process entry: ``python -m kvxfer.serving.workers --role R --ipc-fd FD ...``.

Order matters: pin CPUs and size torch's thread pool before the model loads
(the pool is created on first use), then load the model, create and register
the agent, and only then report ``ready`` with the agent's address.

Two ways to reach the router: ``--ipc-fd`` (spawned by ``kvxfer serve``, a
private socket pair; the worker exits with its router) or ``--listen HOST:PORT``
(``kvxfer worker`` on any host: an authenticated TCP channel,
:mod:`kvxfer.serving.channel.netchannel`; the worker outlives routers and, with
``--discovery``, publishes itself so routers find it).

The agents' shared secret: ``KVXFER_AGENT_SECRET`` (hex, set by ``kvxfer serve``
for its own workers), else ``--secret-file PATH``, else ``KVXFER_SECRET`` (text);
at least 16 bytes; removed from the environment once read. The store nodes' secret
(``--store``): ``--store-secret-file``, else ``--secret-file``, else ``KVXFER_SECRET``.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import sys

from ...secrets import load_secret, normalize_secret
from ..channel.ipc import AGENT_SECRET_ENV
from ..engine.config import SCHEDULES, EngineConfig
from ..model.config import MATMUL_DTYPES


def worker_secret(secret_file: str | None = None, *, for_store: bool = False) -> bytes:
    """This worker's shared secret (see the module docstring); ValueError if absent/short.
    ``for_store``: the store nodes' secret (``--store``): never ``kvxfer serve``'s per-server
    agent secret, and ``$KVXFER_SECRET`` stays in the environment for the agents' own call."""
    if os.environ.get(AGENT_SECRET_ENV) and not for_store:
        return normalize_secret(bytes.fromhex(os.environ.pop(AGENT_SECRET_ENV)))
    return load_secret(secret_file, remove=not for_store)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvxfer.serving.workers")
    p.add_argument("--name", required=True)
    p.add_argument("--role", required=True, choices=("prefill", "decode", "colocated"))
    p.add_argument("--ipc-fd", type=int, default=None, help="socket pair end (kvxfer serve)")
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="control address routers connect to (kvxfer worker)")
    p.add_argument("--agent-listen", default=None, metavar="HOST:PORT",
                   help="the agent's address (default: the --listen host, any port)")
    p.add_argument("--discovery", default=None, metavar="URL", help="etcd://HOST:PORT[/prefix]")
    p.add_argument("--ttl", type=float, default=5.0, help="discovery lease, seconds")
    p.add_argument("--secret-file", default=None)
    p.add_argument("--store", default=None, metavar="URL|NODES",
                   help="the KV pool (etcd://HOST:PORT[/prefix] or HOST:PORT,...): prefill reads and fills it")
    p.add_argument("--store-secret-file", default=None, metavar="PATH",
                   help="the store nodes' secret (default: --secret-file, else $KVXFER_SECRET)")
    p.add_argument("--model", default=None)
    p.add_argument("--cpus", default=None, help="CPU list to pin to, e.g. 0 or 2-3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nice", type=int, default=0, choices=range(20), metavar="N",
                   help="add this much nice (0-19: lower priority), before any thread starts")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: --engine sim, the profile's KV capacity at --tp; "
                        "else 1024)")
    p.add_argument("--tp", type=int, default=1, metavar="K",
                   help="--engine sim: the tensor-parallel degree modelled (the profile's fit "
                        "and KV capacity at K, K GPUs' links)")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--schedule", choices=SCHEDULES, default=EngineConfig.schedule)
    p.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default=EngineConfig.matmul_dtype)
    p.add_argument("--engine", choices=("real", "sim"), default="real",
                   help="sim: the simulated engine (kvxfer.sim), forward pass modelled by --profile")
    p.add_argument("--profile", default=None, metavar="NAME|FILE", help="--engine sim: cost profile")
    p.add_argument("--sim-kv-scale", type=float, default=None, metavar="S",
                   help="--engine sim: the pool's blocks hold the real block bytes / S (default 256)")
    p.add_argument("--sim-devices", type=int, default=None, metavar="K",
                   help="--engine sim: share K modelled devices with the workers of --sim-share")
    p.add_argument("--sim-share", default=None, metavar="PATH:SLOT",
                   help="--sim-devices: the busy file the server made, and this worker's slot")
    p.add_argument("--step-log", default=None, metavar="DIR",
                   help="append every step (chunks, forward+sampling seconds) to DIR/NAME.jsonl")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--on-transfer-failure", choices=("fail", "recompute"), default="recompute")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if (args.ipc_fd is None) == (args.listen is None):
        p.error("give exactly one of --ipc-fd and --listen")
    if args.listen is not None and args.role == "colocated":
        p.error("--listen workers are prefill or decode")
    if (args.engine == "sim") != (args.profile is not None):
        p.error("--engine sim needs --profile NAME|FILE (and --profile needs --engine sim)")
    if args.tp != 1 and args.engine != "sim":
        p.error("--tp is modelled by the simulated engine only: --engine sim")
    if (args.sim_devices is None) != (args.sim_share is None) or (
            args.sim_devices is not None and args.engine != "sim"):
        p.error("--sim-devices and --sim-share go together, with --engine sim")
    return args


def pin_threads(cpus: str | None, num_threads: int) -> None:
    """Pin this process to ``cpus`` (a CPU group, e.g. ``"0-3"``) and torch to ``num_threads`` threads."""
    import torch

    from ..engine.config import parse_cpu_group

    if cpus:
        os.sched_setaffinity(0, parse_cpu_group(cpus))
    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (a pool started): harmless
        pass


def _make_agent(name: str, runtime, lease_timeout_s: float, released: queue.SimpleQueue,
                secret: bytes, listen: str):
    from ... import Agent, AgentConfig

    agent = Agent(name, listen=listen, secret=secret, config=AgentConfig.from_env(lease_timeout=lease_timeout_s),
                  on_release=lambda request_id, block_ids, reason: released.put(request_id))
    agent.register_kv(runtime.cache.kv_layout())
    return agent


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nice:  # before any thread starts (channel reader, torch pools, agent): they inherit it
        os.nice(args.nice)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    from ..channel.ipc import WorkerChannel

    try:
        # the store's secret first: the agents' call takes the environment's secrets out of it
        store_secret = worker_secret(args.store_secret_file or args.secret_file, for_store=True) if args.store else None
        secret = worker_secret(args.secret_file)
        if args.listen is not None:
            from ..channel.netchannel import NetWorkerChannel

            channel = NetWorkerChannel(args.listen, secret)
        else:
            channel = WorkerChannel.from_fd(args.ipc_fd)
    except (ValueError, OSError) as exc:
        logging.error("cannot start: %s", exc)
        return 2
    agent = None
    registration = None
    ctx = None
    try:
        pin_threads(args.cpus, args.threads)
        from .loop import WorkerContext

        profile = None
        if args.engine == "sim":
            from ..simulated.profile import load_profile

            profile = load_profile(args.profile).at_tp(args.tp)
        num_blocks = args.num_blocks or (EngineConfig.num_blocks if profile is None else
                                         profile.default_num_blocks(EngineConfig.num_blocks))
        config = EngineConfig(model_path=args.model, num_blocks=num_blocks,
                              max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              schedule=args.schedule, matmul_dtype=args.matmul_dtype,
                              num_threads=args.threads)
        runtime = _runtime(config, args, profile)
        if args.step_log:
            runtime.step_log = _step_log(args, runtime)
        released: queue.SimpleQueue = queue.SimpleQueue()
        if args.role != "colocated":
            agent_listen = args.agent_listen or (
                f"{args.listen.rpartition(':')[0]}:0" if args.listen else "127.0.0.1:0")
            agent = _make_agent(args.name, runtime, args.transfer_timeout, released, secret,
                                agent_listen)
        ctx = WorkerContext(args.name, args.role, channel, runtime, agent,
                            args.transfer_timeout, args.on_transfer_failure, released,
                            args.request_timeout)
        if args.store and args.role != "colocated":
            ctx.pool = _open_pool(args, store_secret, runtime)
        worker = _role_loop(ctx)
    except Exception as exc:
        logging.exception("startup failed")
        channel.send({"ev": "start_failed", "error": f"{type(exc).__name__}: {exc}"})
        if ctx is not None and ctx.pool is not None:
            ctx.pool.close()
        if agent is not None:
            agent.close()
        channel.close()
        return 1
    ready = {"ev": "ready", "name": args.name, "role": args.role, "pid": os.getpid(),
             "agent_address": agent.address if agent is not None else None,
             "transport": _transport(agent), "model": runtime_model_name(args.model),
             "num_blocks": config.num_blocks, "block_size": config.block_size,
             "threads": args.threads, "matmul": runtime.matmul_dtype,
             "kv_fingerprint": runtime.cache.kv_layout().fingerprint(),
             "cpus": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
             "engine": args.engine}
    channel.send(ready)
    try:
        if args.discovery:
            registration = _publish(args, channel.address, ready)
        if args.listen is not None:  # a standalone worker: Ctrl-C drains it like SIGTERM
            import signal

            signal.signal(signal.SIGINT, lambda *_: setattr(worker, "is_draining", True))
        return _serve(worker)
    finally:
        if registration is not None:
            registration.close()  # withdrawn at once, not at lease expiry
        if ctx.pool is not None:
            ctx.pool.close()
        if agent is not None:
            agent.close()
        channel.close()
        if runtime.step_log is not None:
            runtime.step_log.close()


def _step_log(args, runtime):
    """``--step-log DIR``: this worker's :class:`~kvxfer.serving.engine.step_log.StepLog`,
    ``DIR/NAME.jsonl`` (appended to: a restarted worker adds a header and goes on)."""
    from ..simulated.measure import cpu_name
    from ..engine.step_log import StepLog

    if os.sep in args.name or args.name in (".", ".."):
        raise ValueError(f"--step-log: the worker name {args.name!r} is not a file name")
    os.makedirs(args.step_log, exist_ok=True)
    profile = getattr(runtime, "profile", None)  # the simulated engine: the modelled model's bytes
    kv_bytes = (profile.kv_bytes_per_token if profile is not None
                else runtime.cache.bytes_per_block // runtime.block_size)
    return StepLog(os.path.join(args.step_log, f"{args.name}.jsonl"),
                   {"name": args.name, "role": args.role, "engine": args.engine,
                    "hardware": cpu_name(),
                    "profile": args.profile, "threads": args.threads,
                    "matmul": runtime.matmul_dtype, "model": runtime_model_name(args.model),
                    "block_size": runtime.block_size,
                    "kv_bytes_per_token": kv_bytes})


def _open_pool(args, secret: bytes, runtime):
    """The prefill role's :class:`~kvxfer.serving.workers.pool.PrefillPool` on ``--store``."""
    from ...store import KVStore
    from .pool import PrefillPool, model_salt

    where = ({"discovery": args.store} if args.store.startswith("etcd://")
             else {"nodes": [a.strip() for a in args.store.split(",") if a.strip()]})
    store = KVStore(**where, secret=secret)
    salt = model_salt(runtime_model_name(args.model), runtime.matmul_dtype, runtime.cache.kv_layout())
    return PrefillPool(store, runtime, salt)


def _runtime(config: EngineConfig, args, profile=None):
    """The engine core: the model (``--engine real``) or the simulated engine (``profile``
    at its degree)."""
    if args.engine == "sim":
        from ..simulated.pool import DEFAULT_KV_SCALE
        from ..simulated.runtime import SimRuntime

        devices = None
        if args.sim_devices is not None:
            from ..simulated.devices import SharedDevices

            path, _, slot = args.sim_share.rpartition(":")
            devices = SharedDevices(path, int(slot), args.sim_devices)
        runtime = SimRuntime(config, profile,
                             args.sim_kv_scale or DEFAULT_KV_SCALE, devices)
        logging.info("simulated engine: profile %s (%s, %s); KV pool %d B/block = real %d B / "
                     "%.1f", runtime.profile.name, runtime.profile.model,
                     runtime.profile.hardware, runtime.cache.bytes_per_block,
                     runtime.profile.block_bytes, runtime.pool.scale)
        return runtime
    from ..engine.runtime import Runtime

    return Runtime.load(config)


def _role_loop(ctx):
    """The message loop of ``ctx.role`` over ``ctx``'s runtime and agent."""
    if ctx.role == "prefill":
        from .prefill import PrefillWorker as Role
    else:
        from .decode import DecodeWorker as Role
    return Role(ctx)


def _serve(worker) -> int:
    """Run ``worker``; after a drained ``switch_role``, go on in the new role.

    The switch happens only with every KV block free and nothing scheduled: a
    block still held means a request (or a recv that may still be written) is
    alive, so the worker stays in its role and reports ``ok: false``.
    """
    while True:
        code = worker.run()
        role = worker.next_role
        if role is None:
            return code
        ctx, runtime = worker.ctx, worker.runtime
        free, total = runtime.blocks.num_free_blocks, runtime.blocks.num_blocks
        if free != total or runtime.scheduler.has_work():
            logging.error("not switching to %s: %d of %d KV blocks still held", role,
                          total - free, total)
            worker.is_draining, worker.next_role = False, None
            worker.send({"ev": "role_changed", "ok": False, "role": ctx.role,
                         "error": f"{total - free} KV blocks still held"})
            continue
        old, ctx.role = ctx.role, role
        worker = _role_loop(ctx)
        logging.info("switched role %s -> %s (%d/%d KV blocks free)", old, role, free, total)
        worker.send({"ev": "role_changed", "ok": True, "role": role, "free_blocks": free,
                     "num_blocks": total})


def runtime_model_name(model_path: str | None) -> str:
    """The model's name as the router derives it (the GGUF file's base name)."""
    from ..model.gguf_loader import default_model_path

    return os.path.basename(model_path or default_model_path()).split(".")[0]


def _publish(args, control_address: str, ready: dict):
    from ...discovery import Member, open_discovery

    member = Member(name=args.name, role=args.role, address=control_address,
                    agent_address=ready["agent_address"], model=ready["model"],
                    info={"num_blocks": ready["num_blocks"], "block_size": ready["block_size"],
                          "pid": ready["pid"]})
    registration = open_discovery(args.discovery).publish(member, args.ttl)
    logging.info("published %s (%s) at %s in %s", args.name, args.role, control_address,
                 args.discovery)
    return registration


def _transport(agent) -> str | None:
    """The agent's backend (per-peer transports appear in its metrics once connected)."""
    return None if agent is None else agent.metrics.info.get("backend")
