"""``kvxfer serve``: the reference prefill/decode server (OpenAI-compatible HTTP)."""
from __future__ import annotations

import argparse
import os

from kvxfer.serving.engine.config import SCHEDULES, EngineConfig
from kvxfer.serving.model.config import MATMUL_DTYPES

API_KEY_ENV = "KVXFER_API_KEY"


# ServeConfig field -> (flag, metavar, help); the type and default are the field's
CONFIG_OPTIONS = {
    "local_prefill_tokens": ("--local-prefill-tokens", "N", "disaggregated: prefill uncached prompts shorter "
                             "than N tokens on the decode worker (0: off)"),
    "local_prefill_queue": ("--local-prefill-queue", "K", "disaggregated: prefill on the decode worker while "
                            "the prefill worker holds K or more requests (0: off)"),
    "prefill_nice": ("--prefill-nice", "N", "disaggregated: prefill workers run at N (0-19) more nice levels "
                     "(lower priority) than decode workers, so a decode worker sharing their CPU group (one "
                     "--cpus group for all) takes the CPU first (0: off)"),
    "header_timeout_s": ("--header-timeout", "S", "close a connection whose request headers are not complete "
                         "S seconds after it opened or its previous response ended"),
    "body_timeout_s": ("--body-timeout", "S", "answer 408 and close when a request body is not complete "
                       "S seconds after its headers"),
    "keep_alive_timeout_s": ("--keep-alive-timeout", "S", "close a keep-alive connection idle for S seconds"),
    "limit_concurrency": ("--limit-concurrency", "N",
                          "keep at most N connections open (those still without request headers are closed "
                          "first) and answer 503 while N requests are in flight (/health and /metrics always "
                          "answered)"),
    "max_connections_per_source": ("--max-connections-per-source", "N",
                                   "keep at most N connections of one client address (those still without "
                                   "request headers are closed first)"),
}


def add_config_options(group, *names: str) -> None:
    """One option per :class:`~kvxfer.serving.server.serve_config.ServeConfig` field in
    ``names`` (:data:`CONFIG_OPTIONS`), typed and defaulted as the field is."""
    from kvxfer.serving.server.serve_config import ServeConfig

    fields = ServeConfig.__dataclass_fields__
    for name in names:
        flag, metavar, help_text = CONFIG_OPTIONS[name]
        default = fields[name].default
        group.add_argument(flag, type=type(default), default=default, metavar=metavar, help=help_text)


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
    p.add_argument("--config", default=None, metavar="NAME",
                   help="the workers as kvxfer simulate names them, instead of --prefill/--decode/"
                        "--colocated: colocated:N[@K], xPyD[@A[,B]] (@: tensor-parallel degrees, "
                        "--engine sim), conditional:xPyD, adaptive:xPyD (docs/simulate.md)")
    p.add_argument("--model", default=None, metavar="PATH.gguf",
                   help="Llama-family GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cpus", nargs="+", default=(), metavar="LIST",
                   help="CPU group per worker (prefill workers first), e.g. --cpus 0 1; "
                        "one group is shared by all")
    p.add_argument("--threads", type=int, default=None, metavar="T",
                   help="torch threads per worker (default: its CPU group's size)")
    p.add_argument("--on-transfer-failure", choices=("fail", "recompute"), default="recompute")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per worker (default 1024; --engine sim: the profile's KV "
                        "capacity at the worker's tensor-parallel degree)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences a step (default 16; --engine sim: the profiled engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens a step (default 512; --engine sim: the profiled engine's)")
    p.add_argument("--schedule", choices=SCHEDULES, default=EngineConfig.schedule,
                   help="mixed: decode tokens and prompt chunks share each step (chunked "
                        "prefill); separate: prefill steps and decode steps apart; "
                        "prefill-first: whole prompts first (--no-enable-chunked-prefill)")
    p.add_argument("--no-enable-chunked-prefill", dest="schedule", action="store_const",
                   const="prefill-first", help="whole prompts, run before any decode (vLLM's flag)")
    p.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default=EngineConfig.matmul_dtype,
                   help="projection dtype of every worker: auto (bf16 where the CPU has AMX, "
                        "else fp32), fp32 or bf16; P and D must agree")
    add_config_options(p, "local_prefill_tokens", "local_prefill_queue", "prefill_nice")
    p.add_argument("--transfer-timeout", type=float, default=30.0, metavar="S")
    add_engine_args(p)
    p.add_argument("--sim-devices", type=int, default=None, metavar="K",
                   help="--engine sim: the workers share K modelled devices (a step runs at "
                        "min(1, K/busy workers) speed), as workers sharing K cores do; default: "
                        "a device each")
    p.add_argument("--retries", type=int, default=0, metavar="N",
                   help="place a request again (up to N times) on another worker of the same "
                        "role when its worker dies or fails before any token was streamed")
    p.add_argument("--routing", choices=("least-loaded", "kv"), default="least-loaded",
                   help="how a request's worker is picked: the least-loaded one, or (kv) the one "
                        "of least cost in blocks (prompt blocks it must prefill, weighted, plus "
                        "blocks its requests hold) among those within --routing-load-gap "
                        "requests of the least-loaded (docs/serving.md)")
    p.add_argument("--routing-load-gap", type=int, default=4, metavar="N",
                   help="--routing kv: the load excess (requests) past which a prefix hit no "
                        "longer draws the request")
    p.add_argument("--routing-overlap-weight", type=float, default=None, metavar="W",
                   help="--routing kv: a prompt block to prefill costs as much as W blocks held "
                        "(default 4)")
    a = p.add_argument_group("adaptive P/D rebalancing (docs/serving.md)")
    a.add_argument("--adaptive", action="store_true",
                   help="move workers between the prefill and decode roles as the mix shifts "
                        "(needs >= 3 workers)")
    add_adaptive_timing(a)
    a.add_argument("--adaptive-sustain", type=int, default=3, metavar="K",
                   help="observations in a row that must want the same move")
    a.add_argument("--adaptive-prefill-queue", default="1,4", metavar="LOW,HIGH",
                   help="prompts waiting per prefill worker: cool at <= LOW, hot at >= HIGH")
    a.add_argument("--adaptive-decode-active", default="3,8", metavar="LOW,HIGH",
                   help="decoding requests per decode worker: cool / hot")
    a.add_argument("--adaptive-kv", default="0.6,0.9", metavar="LOW,HIGH",
                   help="decode workers' KV pool use by requests past their first token "
                        "(0..1): cool / hot")
    a.add_argument("--adaptive-admit-queue", default="0,1", metavar="LOW,HIGH",
                   help="requests waiting for decode KV blocks per decode worker: cool / hot")
    a.add_argument("--adaptive-slo", default=None, metavar="TTFT_MS,TPOT_MS",
                   help="also watch TTFT/TPOT attainment of the last 32 requests against this SLO")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /metrics "
                        f"(default: ${API_KEY_ENV}; prefer the variable: a command line is visible in ps)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="larger request bodies get HTTP 413 (default 1 MiB)")
    h = p.add_argument_group("HTTP connection limits (docs/serving.md)")
    add_config_options(h, "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "limit_concurrency",
                       "max_connections_per_source")
    p.add_argument("--discovery", default=None, metavar="URL",
                   help="etcd://HOST:PORT[/prefix] or static://HOST:PORT,...: route to workers "
                        "started with `kvxfer worker` (shared secret: $KVXFER_SECRET or --secret-file)")
    p.add_argument("--secret-file", default=None, metavar="PATH")
    p.add_argument("--store", default=None, metavar="URL|NODES",
                   help="the KV pool prefill workers read and fill: etcd://HOST:PORT[/prefix] or "
                        "HOST:PORT,... (store nodes; secret: $KVXFER_SECRET or --secret-file)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def add_adaptive_timing(p) -> None:
    """``--adaptive-interval`` and ``--adaptive-dwell``, the rebalancer's periods (defaults:
    :class:`~kvxfer.serving.server.adaptive_policy.AdaptivePolicy`'s), for ``kvxfer serve``
    and the virtual clock's ``simulate`` and ``plan``."""
    from kvxfer.serving.server.adaptive_policy import AdaptivePolicy

    default = AdaptivePolicy()
    p.add_argument("--adaptive-interval", type=float, default=default.interval_s, metavar="S",
                   help="adaptive: seconds between the rebalancer's observations")
    p.add_argument("--adaptive-dwell", type=float, default=default.min_dwell_s, metavar="S",
                   help="adaptive: minimum seconds between two role changes")


def add_engine_args(p) -> None:
    """``--engine real|sim``, ``--profile``, ``--sim-kv-scale`` (serve and worker)."""
    p.add_argument("--engine", choices=("real", "sim"), default="real",
                   help="sim: simulated accelerators, the forward pass modelled by --profile "
                        "(docs/simulate.md); everything else is the real stack")
    p.add_argument("--profile", default=None, metavar="NAME|FILE",
                   help="--engine sim: a cost profile (kvxfer profile --list, or a JSON file)")
    p.add_argument("--sim-kv-scale", type=float, default=None, metavar="S",
                   help="--engine sim: pool blocks hold the real model's block bytes / S "
                        "(default 256)")
    p.add_argument("--step-log", default=None, metavar="DIR",
                   help="each worker appends every step it runs (chunks, forward+sampling "
                        "seconds) to DIR/NAME.jsonl: what kvxfer profile --from-steps fits")


def _layout(args: argparse.Namespace) -> dict:
    """``--config NAME``'s worker counts, TP degrees and conditional/adaptive flags."""
    from kvxfer.sim.configs import LOCAL_PREFILL_QUEUE, LOCAL_PREFILL_TOKENS, layout_of

    if args.prefill or args.decode or args.colocated:
        raise ValueError("--config excludes --prefill/--decode/--colocated")
    lay = layout_of(args.config)  # ConfigError (a ValueError) naming the grammar
    if max(lay.prefill_tp, lay.decode_tp) > 1 and args.engine != "sim":
        raise ValueError(f"{args.config}: tensor-parallel degrees are modelled by --engine sim only")
    if lay.kind == "colocated":
        return {"num_prefill": 0, "num_decode": 0, "num_colocated": lay.num_prefill,
                "tp_degrees": (lay.prefill_tp,)}
    out = {"num_prefill": lay.num_prefill, "num_decode": lay.num_decode, "num_colocated": 0,
           "tp_degrees": (lay.prefill_tp,) * lay.num_prefill + (lay.decode_tp,) * lay.num_decode}
    if lay.kind == "conditional":
        out.update(local_prefill_tokens=LOCAL_PREFILL_TOKENS, local_prefill_queue=LOCAL_PREFILL_QUEUE)
    if lay.kind == "adaptive":
        args.adaptive = True
    return out


def _budgets(args: argparse.Namespace) -> dict:
    """``--max-num-seqs`` and ``--max-num-batched-tokens``, where not given the profiled
    engine's (``--engine sim``, as kvxfer simulate takes them) or the engine's defaults."""
    engine = {}
    if args.engine == "sim" and args.profile:
        from kvxfer.serving.simulated.profile import load_profile

        engine = load_profile(args.profile).engine  # ProfileError: a ValueError
    whole = args.schedule != "mixed"
    budget = engine.get("max_num_batched_tokens" if whole else "chunked_prefill_tokens",
                        EngineConfig.max_num_batched_tokens)
    return {"max_num_seqs": args.max_num_seqs or engine.get("max_num_seqs", EngineConfig.max_num_seqs),
            "max_num_batched_tokens": args.max_num_batched_tokens or budget}


def config_from_args(args: argparse.Namespace):
    from kvxfer.serving.engine.config import parse_cpu_group
    from kvxfer.serving.server.serve_config import ServeConfig

    layout = _layout(args) if args.config else {}
    budgets = _budgets(args)
    if args.colocated and (args.prefill or args.decode):
        raise SystemExit("kvxfer serve: --colocated excludes --prefill/--decode")
    if args.discovery and args.colocated:
        raise SystemExit("kvxfer serve: --discovery serves prefill/decode workers only")
    default = 0 if args.colocated or args.discovery else 1
    spawned = 0 if args.colocated or args.discovery else None  # discovery: see _local_workers
    counts = {"num_prefill": spawned if spawned is not None else (args.prefill or default),
              "num_decode": spawned if spawned is not None else (args.decode or default),
              "num_colocated": args.colocated,
              "local_prefill_tokens": args.local_prefill_tokens,
              "local_prefill_queue": args.local_prefill_queue, **layout}
    return ServeConfig(
        host=args.host, port=args.port, discovery=args.discovery, secret_file=args.secret_file,
        model_path=args.model, store=args.store,
        cpu_groups=tuple(parse_cpu_group(g) for g in args.cpus),
        on_transfer_failure=args.on_transfer_failure, num_threads=args.threads,
        num_blocks=args.num_blocks, **budgets, **counts,
        schedule=args.schedule, matmul_dtype=args.matmul_dtype, prefill_nice=args.prefill_nice,
        transfer_timeout_s=args.transfer_timeout, log_level=args.log_level,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes, retries=args.retries,
        routing=args.routing, routing_load_gap=args.routing_load_gap,
        **({} if args.routing_overlap_weight is None
           else {"routing_overlap_weight": args.routing_overlap_weight}),
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout, limit_concurrency=args.limit_concurrency,
        max_connections_per_source=args.max_connections_per_source,
        adaptive=_adaptive_policy(args) if args.adaptive else None,
        adaptive_slo_ms=_pair(args.adaptive_slo, "--adaptive-slo") if args.adaptive_slo else None,
        engine=args.engine, profile=args.profile, sim_kv_scale=args.sim_kv_scale,
        step_log_dir=args.step_log, sim_devices=args.sim_devices)


def _pair(text: str, flag: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected two numbers A,B, got {text!r}") from None
    return low, high


def _adaptive_policy(args: argparse.Namespace):
    from kvxfer.serving.server.adaptive_policy import AdaptivePolicy

    pq = _pair(args.adaptive_prefill_queue, "--adaptive-prefill-queue")
    da = _pair(args.adaptive_decode_active, "--adaptive-decode-active")
    kv = _pair(args.adaptive_kv, "--adaptive-kv")
    aq = _pair(args.adaptive_admit_queue, "--adaptive-admit-queue")
    return AdaptivePolicy(interval_s=args.adaptive_interval, min_dwell_s=args.adaptive_dwell,
                          sustain=args.adaptive_sustain,
                          prefill_queue_low=pq[0], prefill_queue_high=pq[1],
                          decode_active_low=da[0], decode_active_high=da[1],
                          kv_use_low=kv[0], kv_use_high=kv[1],
                          admit_queue_low=aq[0], admit_queue_high=aq[1])


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvxfer.net import raise_fd_limit
    from kvxfer.serving.server.http_limits import uvicorn_options
    from kvxfer.serving.server.router import create_app

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"kvxfer serve: {exc}") from None
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s router %(levelname)s %(message)s")
    local = _local_workers(args, config) if args.discovery else None
    try:
        # uvicorn's SIGTERM/SIGINT handling stops accepting, lets in-flight
        # responses finish (bounded), then runs the lifespan exit: workers drain.
        # Connection limits: kvxfer.serving.server.http_limits.
        uvicorn.run(create_app(config), host=config.host, port=config.port,
                    log_level=args.log_level, **uvicorn_options(config, raise_fd_limit()))
    finally:
        if local is not None:
            local.stop(config.drain_timeout_s)
    return 0


def _local_workers(args: argparse.Namespace, config):
    """``--discovery`` with ``--prefill N``/``--decode M``: start that many ``kvxfer worker``
    processes on this host; they publish themselves like any other worker (listening on
    ``--host``, or 127.0.0.1 when that is a wildcard) and are found through discovery.
    They share the router's process group, are restarted with backoff when they die
    (:mod:`kvxfer.serving.server.local_workers`) and drained when it exits."""
    import sys

    from kvxfer.serving.server.launcher import sim_args
    from kvxfer.serving.server.local_workers import LocalWorkers
    from kvxfer.serving.engine.config import parse_cpu_group

    roles = ["prefill"] * (args.prefill or 0) + ["decode"] * (args.decode or 0)
    if roles:
        from kvxfer.secrets import load_secret

        try:
            load_secret(args.secret_file)  # the workers load it again; here only its absence is told early
        except (OSError, ValueError) as exc:
            raise SystemExit(f"kvxfer serve: {exc} (--secret-file; shared with the workers)") from None
    groups = [parse_cpu_group(g) for g in args.cpus]
    if len(groups) not in (0, 1, len(roles)):
        raise SystemExit(f"kvxfer serve: --cpus: give 1 group or one per worker ({len(roles)})")
    host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else args.host
    argvs = []
    for i, role in enumerate(roles):
        argv = [sys.executable, "-m", "kvxfer.cli", "worker", "--role", role,
                "--listen", f"{host}:0", "--discovery", args.discovery,
                "--name", f"{role}-{os.uname().nodename}-{os.getpid()}-{i}",
                "--max-num-seqs", str(config.max_num_seqs),
                "--max-num-batched-tokens", str(config.max_num_batched_tokens),
                "--matmul-dtype", args.matmul_dtype,
                "--transfer-timeout", str(args.transfer_timeout),
                "--on-transfer-failure", args.on_transfer_failure, "--log-level", args.log_level]
        argv += sim_args(config)
        for flag, value in (("--num-blocks", args.num_blocks and str(args.num_blocks)),
                            ("--model", args.model), ("--secret-file", args.secret_file), ("--store", args.store),
                            ("--threads", args.threads and str(args.threads)),
                            ("--cpus", args.cpus[i if len(groups) > 1 else 0] if groups else None)):
            if value:
                argv += [flag, value]
        argvs.append(argv)
    return LocalWorkers(argvs, config.restart_backoff_s, config.restart_backoff_max_s).start()
