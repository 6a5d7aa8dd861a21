"""``kvxfer bench transfer --vs-perftest``: does the bench itself add overhead?

A 64 MiB single-descriptor write through kvxfer's UCX backend against
``ucx_perftest -t ucp_put_bw`` (the libucx wheel ships it) in the same session,
same environment (``UCX_TLS`` etc. apply to both), interleaved in rounds. UCX
prints MB/s with MB = 2**20 bytes; everything here is converted to 1e9 B/s.
Target: kvxfer within 10% of perftest.
"""
from __future__ import annotations

import socket
import subprocess
import time

from .. import report
from ..report import envinfo
from ..report.stats import gbps, summarize

SIZE = 64 << 20
TARGET_RATIO = 0.9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perftest_gbps(size: int, iters: int, warmup: int, timeout: float) -> float:
    """Average put bandwidth of one ``ucx_perftest`` server/client pair on loopback, GB/s."""
    from ..errors import KVXferError, TransferTimeout

    tool = envinfo.ucx_tool("ucx_perftest")
    if tool is None:
        raise KVXferError("ucx_perftest not found (libucx wheel or PATH)")
    exe, env = tool
    port = str(_free_port())
    server = subprocess.Popen([exe, "-p", port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = None
        deadline = time.monotonic() + timeout
        while out is None:  # the server needs a moment to listen
            res = subprocess.run([exe, "127.0.0.1", "-p", port, "-t", "ucp_put_bw", "-s", str(size),
                                  "-n", str(iters), "-w", str(warmup)], env=env, capture_output=True,
                                 text=True, timeout=timeout)
            if res.returncode == 0:
                out = res.stdout
            elif time.monotonic() > deadline:
                raise TransferTimeout(f"ucx_perftest failed: {res.stderr.strip()[-300:]}")
            else:
                time.sleep(0.2)
    finally:
        server.kill()
        server.wait(timeout=10)
    for line in out.splitlines():
        if line.startswith("Final:"):
            fields = line.split()
            return float(fields[5]) * (1 << 20) / 1e9  # bandwidth average, MB/s (2**20)
    raise KVXferError(f"unexpected ucx_perftest output: {out[-300:]}")


def compare(args) -> int:
    from ..errors import KVXferError
    from .kvx_session import KvxSession

    backend = "ucx" if args.backend == "auto" else args.backend
    iters = max(args.iters, 5)
    rounds = max(args.rounds, 2)
    warning, load0 = envinfo.busy_warning(), envinfo.load_average()
    if warning:
        report.warn(warning)
    rows = []
    try:
        with KvxSession(backend, slot_bytes=SIZE, batch=1, timeout=args.timeout) as kvx:
            for r in range(rounds):  # A B A B
                pt = perftest_gbps(SIZE, iters, args.warmup, args.timeout)
                s = kvx.measure(SIZE, 1, "write", iters, args.warmup, path="zero-copy", check=args.check)
                lat = s["latency_s"]
                rows.append({"round": r, "transport": kvx.transport, "perftest_gbps": pt,
                             "kvxfer_gbps": gbps(SIZE, summarize(lat).median),
                             "kvxfer_overall_gbps": gbps(SIZE * len(lat), sum(lat)),
                             "samples": s})
                rows[-1]["ratio"] = rows[-1]["kvxfer_overall_gbps"] / pt
    except KVXferError as exc:
        report.warn(str(exc))
        return 1
    ratio = summarize(r["ratio"] for r in rows).median
    report.print_table(f"64 MiB single-descriptor write: kvxfer ({backend}) vs ucx_perftest put_bw",
                       [("round", "round"), ("transport", "transport"), ("kvxfer GB/s (median)", "kvxfer_gbps"),
                        ("kvxfer GB/s (overall)", "kvxfer_overall_gbps"), ("ucx_perftest GB/s", "perftest_gbps"),
                        ("kvxfer/perftest", "ratio")], rows,
                       caption=f"median ratio {ratio:.2f} (target >= {TARGET_RATIO}); overall = "
                               "bytes / total time, as perftest averages")
    if args.json:
        report.write_json(args.json, benchmark="transfer-vs-perftest",
                          args={k: v for k, v in vars(args).items() if k != "func"},
                          environment=envinfo.collect(backend=backend, transport=rows[0]["transport"],
                                                      load_average_at_start=list(load0)),
                          rows=rows, extra={"median_ratio": ratio})
    return 0
