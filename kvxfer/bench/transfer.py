"""``kvxfer bench transfer``: a point-to-point sweep over block sizes, like nixlbench.

    kvxfer bench transfer                                   # 4 KiB..1 MiB, batch 32, write
    kvxfer bench transfer --compare nixl --json t.json --plot t.png
    kvxfer bench transfer --check --iters 5                 # verify every byte
    kvxfer bench transfer --vs-perftest                     # 64 MiB vs ucx_perftest put_bw

Every row prints its ratio to the limit measured in the same run: a native
copy of the row's bytes on as many threads as the path copies with
(:mod:`kvxfer.bench.resources`, :mod:`kvxfer.bench.copy_limit`), or, when the
transport is TCP, a native loopback TCP socket loop (:mod:`kvxfer.bench.tcp_limit`).
With ``--compare nixl`` kvxfer and NIXL alternate in rounds (A B A B) per row;
across hosts ``--listen HOST:PORT --compare nixl`` also serves a NIXL target on
PORT + 1, which ``--connect HOST:PORT --compare nixl`` uses.
"""
from __future__ import annotations

import os

from .. import report
from ..report import envinfo
from ..report.stats import gbps, summarize

SAMPLE_KEYS = ("prepare_s", "post_s", "transfer_s", "latency_s")


def parse_size(text: str) -> int:
    """``4096``, ``4K``/``4KiB``, ``1M``, ``64MiB`` -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    value = int(t[:-1] if mult > 1 else t)
    if value <= 0:
        raise ValueError(f"size must be positive: {text}")
    return value * mult


def add_arguments(p) -> None:
    p.add_argument("--backend", default="auto", help="auto|ucx|vm|loopback (default auto)")
    p.add_argument("--start-block-size", type=parse_size, default=4096)
    p.add_argument("--max-block-size", type=parse_size, default=1 << 20)
    p.add_argument("--batch-size", type=int, default=32, help="descriptors (blocks) per transfer")
    p.add_argument("--op", choices=("write", "read"), default="write")
    p.add_argument("--path", choices=("zero-copy", "pack"), default="zero-copy")
    p.add_argument("--iters", type=int, default=50, help="measured iterations per row (all rounds)")
    p.add_argument("--warmup", type=int, default=5, help="discarded iterations before each round")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per row with --compare")
    p.add_argument("--check", action="store_true", help="verify every byte of every iteration")
    p.add_argument("--compare", choices=("nixl",), help="run the same workload through NIXL")
    p.add_argument("--nixl-threads", type=int, default=None, metavar="N",
                   help="NIXL UCX num_threads (a worker and TCP connection each; default: kvxfer's copy threads)")
    p.add_argument("--nixl-split-batch", type=int, default=None, metavar="D",
                   help="NIXL UCX split_batch_size: transfers of >= D descriptors are split across its "
                        "threads' workers (default: NIXL's)")
    p.add_argument("--listen", metavar="HOST:PORT", help="serve as the target for a --connect run")
    p.add_argument("--connect", metavar="HOST:PORT", help="target is a --listen process elsewhere")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one step may take")
    p.add_argument("--vs-perftest", action="store_true",
                   help="64 MiB single-descriptor write vs ucx_perftest put_bw, same session")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--no-progress", action="store_true")


def _block_sizes(args) -> list[int]:
    if args.start_block_size > args.max_block_size:
        raise ValueError("--start-block-size exceeds --max-block-size")
    sizes, s = [], args.start_block_size
    while s <= args.max_block_size:
        sizes.append(s)
        s *= 2
    return sizes


def _us(values) -> dict:
    return summarize(v * 1e6 for v in values).as_dict()


def _row(block_size: int, batch: int, kvx: dict, transport: str, mem: list, limit: dict,
         sock: list | None, nixl: dict | None) -> dict:
    nbytes = block_size * batch
    lat = summarize(kvx["latency_s"])
    row = {"block_size": block_size, "block": report.human_bytes(block_size), "batch": batch,
           "bytes": nbytes, "transport": transport, "path": kvx["path"],
           "gbps": gbps(nbytes, lat.median), "gbps_min": gbps(nbytes, lat.max),
           "gbps_max": gbps(nbytes, lat.min)}
    for key in ("latency", "prepare", "post", "transfer", "unpack"):
        s = _us(kvx[f"{key}_s"])
        row[f"{key}_avg_us"], row[f"{key}_p99_us"] = s["mean"], s["p99"]
    row["memcpy_gbps"] = gbps(nbytes, summarize(mem).median)
    row["memcpy_threads"], row["memcpy_streaming"] = limit["threads"], limit["streaming"]
    row["socket_gbps"] = gbps(nbytes, summarize(sock).median) if sock else None
    use_socket = "tcp" in transport and sock
    row["limit"] = "socket" if use_socket else "memcpy"
    row["ratio_to_limit"] = row["gbps"] / (row["socket_gbps"] if use_socket else row["memcpy_gbps"])
    samples = {"kvxfer": {k: kvx[k] for k in kvx if k != "path"}, "memcpy_s": mem, "socket_s": sock}
    if nixl is not None:
        n_lat = summarize(nixl["latency_s"])
        row["nixl_gbps"] = gbps(nbytes, n_lat.median)
        row["nixl_latency_avg_us"] = n_lat.mean * 1e6
        row["ratio_vs_nixl"] = row["gbps"] / row["nixl_gbps"]
        samples["nixl"] = nixl
    row["samples"] = samples
    return row


COLUMNS = [("block", "block"), ("batch", "batch"), ("GB/s", "gbps"), ("GB/s min-max", "_noise"),
           ("lat avg µs", "latency_avg_us"), ("prep avg/p99 µs", "_prep"), ("post avg/p99 µs", "_post"),
           ("xfer avg/p99 µs", "_xfer"), ("transport", "transport"), ("path", "path"),
           ("memcpy GB/s", "memcpy_gbps"), ("thr", "memcpy_threads"), ("socket GB/s", "socket_gbps"),
           ("/limit", "ratio_to_limit")]
NIXL_COLUMNS = [("NIXL GB/s", "nixl_gbps"), ("kvxfer/NIXL", "ratio_vs_nixl")]


def _display(row: dict) -> dict:
    """Row plus the combined cells the table shows (the JSON keeps the separate numbers)."""
    f = report.fmt
    d = dict(row)
    d["_noise"] = f"{f(row['gbps_min'])}-{f(row['gbps_max'])}"
    for cell, key in (("_prep", "prepare"), ("_post", "post"), ("_xfer", "transfer")):
        d[cell] = f"{f(row[key + '_avg_us'], 1)}/{f(row[key + '_p99_us'], 1)}"
    return d


def _merge(parts: list[dict]) -> dict:
    out = {k: [v for p in parts for v in p[k]] for k in parts[0] if k != "path"}
    if "path" in parts[0]:
        out["path"] = parts[0]["path"]
    return out


def _sweep(args, sizes: list[int], kvx, nixl, sock) -> list[dict]:
    from . import resources
    from .copy_limit import MemcpyLimit

    rounds = args.rounds if nixl is not None else 1
    per_round = max(1, args.iters // rounds)
    rows = []
    with report.progress(len(sizes), "transfer sweep", enabled=not args.no_progress) as advance:
        for bs in sizes:
            kvx_parts, nixl_parts, mem = [], [], []
            nbytes = bs * args.batch_size
            res = resources.for_path(kvx.transport, nbytes)
            limit = MemcpyLimit(nbytes, threads=res.threads, streaming=res.streaming)
            limit.seconds(1, warmup=2)
            for _ in range(rounds):  # A B A B (+ memcpy): drift (other load, clocks) hits all alike
                kvx_parts.append(kvx.measure(bs, args.batch_size, args.op, per_round, args.warmup,
                                             path=args.path, check=args.check))
                mem += limit.seconds(per_round, warmup=1)
                if nixl is not None:
                    nixl_parts.append(nixl.measure(bs, args.batch_size, args.op, per_round, args.warmup))
            sock_s = sock.seconds(nbytes, min(per_round * rounds, 20)) if sock is not None else None
            rows.append(_row(bs, args.batch_size, _merge(kvx_parts), kvx.transport, mem, res.as_dict(),
                             sock_s, _merge(nixl_parts) if nixl_parts else None))
            rows[-1]["memcpy_wins_by_threads"] = {str(k): v for k, v in limit.wins.items()}
            del limit
            advance()
    return rows


def _plot(path: str, rows: list[dict], title: str) -> None:
    xs = [r["block_size"] for r in rows]
    series = {"kvxfer": (xs, [r["gbps"] for r in rows])}
    if rows and "nixl_gbps" in rows[0]:
        series["NIXL"] = (xs, [r["nixl_gbps"] for r in rows])
    series["memcpy limit"] = (xs, [r["memcpy_gbps"] for r in rows])
    if rows and rows[0]["socket_gbps"]:
        series["TCP socket limit"] = (xs, [r["socket_gbps"] for r in rows])
    report.plot_bandwidth(path, series, title=title)


def _nixl_address(address: str) -> str:
    """Where the NIXL target of a ``--listen``/``--connect`` pair listens: the port after kvxfer's."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + 1}"


def _listen(args, secret: bytes) -> int:
    """Serve one ``--connect`` session (and, with ``--compare nixl``, a NIXL target on port + 1)."""
    import multiprocessing as mp

    from .endpoint import listen

    proc = None
    if args.compare == "nixl":
        from . import nixl

        proc = mp.get_context("spawn").Process(target=nixl.listen, daemon=True,
                                               args=(_nixl_address(args.listen), secret, args.timeout))
        proc.start()
    try:
        listen(args.listen, secret, args.timeout)
    finally:
        if proc is not None:
            proc.join(args.timeout)
            if proc.is_alive():
                proc.kill()
    return 0


def run(args) -> int:
    import contextlib

    from ..errors import KVXferError
    from .kvx_session import KvxSession
    from .tcp_limit import SocketLimit

    secret = os.environ.get("KVXFER_BENCH_SECRET", "kvxfer-bench").encode()
    if args.listen:
        return _listen(args, secret)
    if args.vs_perftest:
        from .perftest import compare

        return compare(args)
    if args.compare == "nixl":
        from .nixl import available

        if available() is None:
            report.warn("--compare nixl: NIXL is not importable here "
                        "(pip install --no-deps nixl-cu12); nothing was measured")
            return 2
    sizes = _block_sizes(args)
    warning, load0 = envinfo.busy_warning(), envinfo.load_average()
    if warning:
        report.warn(warning)
    title = f"kvxfer bench transfer: {args.op}, batch {args.batch_size}, backend {args.backend}"
    try:
        with contextlib.ExitStack() as stack:
            kvx = stack.enter_context(KvxSession(args.backend, slot_bytes=sizes[-1], batch=args.batch_size,
                                                 timeout=args.timeout, connect=args.connect, authkey=secret))
            nixl = None
            if args.compare == "nixl":
                from .nixl import NixlSession

                from .resources import for_path

                threads = for_path(kvx.transport, sizes[-1] * args.batch_size).threads  # kvxfer's, at most
                if args.nixl_threads is not None:
                    threads = args.nixl_threads
                nixl = stack.enter_context(NixlSession(
                    2 * args.batch_size * sizes[-1], timeout=args.timeout, threads=threads,
                    split_batch=args.nixl_split_batch,
                    connect=_nixl_address(args.connect) if args.connect else None, authkey=secret))
            try:
                sock = stack.enter_context(SocketLimit(args.timeout))
            except KVXferError as exc:  # no C compiler: the row says "-", not a Python stand-in
                report.warn(f"TCP limit not measured: {exc}")
                sock = None
            rows = _sweep(args, sizes, kvx, nixl, sock)
    except KVXferError as exc:
        report.warn(str(exc))
        return 1
    columns = COLUMNS + (NIXL_COLUMNS if args.compare else [])
    report.print_table(title, columns, [_display(r) for r in rows],
                       caption="GB/s = 1e9 B/s from the median latency; min/max = noise; µs columns: "
                               "avg and p99 over measured iterations (warm-up excluded); memcpy: native "
                               "copy on thr threads, as many as the path copies with; socket: native TCP loop")
    if warning:
        report.warn(warning)
    if args.json:
        env = envinfo.collect(transport=rows[0]["transport"] if rows else None, backend=args.backend,
                              load_average_at_start=list(load0))
        report.write_json(args.json, benchmark="transfer", args={k: v for k, v in vars(args).items()
                                                                  if k != "func"},
                          environment=env, rows=rows)
    if args.plot:
        _plot(args.plot, rows, title)
    return 0
