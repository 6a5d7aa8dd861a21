"""The measurement of ``kvxfer bench e2e``: P processes send, D (this process) times
and verifies every request.

Per timed request: D zeroes its pools (untimed), posts ``recv`` on every D rank and
waits for all handles (timed: recv posted -> every byte visible), checks every
destination byte against P's (untimed, :class:`~.e2e_pools.Expected`), then takes
one sample of the memcpy limit (native copy of the same bytes on the path's copy
threads, :mod:`.resources`). The round-trip phase does the same per 1-block
request, zeroing and checking only that block (on one torch thread: see the
loop). A wrong byte in any request makes
the run fail. Only public API: ``Agent``, ``Peer.transport``, ``TransferHandle.path``,
``Agent.metrics``, ``KVLayout``, ``pack``.
"""
from __future__ import annotations

import multiprocessing as mp
import time

from ..errors import KVXferError
from .e2e_pools import Expected, block_ids, clear, make_layout

SECRET = b"kvxfer-bench-e2e"
TIMEOUT_S = 120.0


def _prefill(spec: dict, rank: int, d_addresses: list, requests: list, rtt: int, q) -> None:
    """P rank ``rank``: connect to every D rank, post every send up front, report."""
    from .. import Agent, AgentConfig

    try:
        layout = make_layout(spec, "p", rank, fill=True)
        # Every send is posted up front and D takes its time between requests (clearing and
        # verifying its pools), so P's leases must outlive the whole run, not the default 30 s.
        lease_s = TIMEOUT_S * (len(requests) + rtt + 1)
        with Agent(f"prefill-{rank}", secret=SECRET, backend=spec["backend"],
                   config=AgentConfig.from_env(path=spec["path"], lease_timeout=lease_s)) as agent:
            agent.register_kv(layout)
            peers = [agent.connect(a, timeout=TIMEOUT_S) for a in d_addresses]
            src = block_ids(spec, 1)
            q.put(("ready", rank, peers[0].transport))
            handles = [agent.send(p, r, src) for r in requests for p in peers]
            handles += [agent.send(p, f"rtt-{i}", [src[0]]) for i in range(rtt) for p in peers]
            for h in handles:
                h.wait(TIMEOUT_S)
            q.put(("done", {"rank": rank, "transport": peers[0].transport,
                            "paths": sorted({h.path for h in handles}),
                            "metrics": agent.metrics.to_dict()["histograms"]}))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        q.put(("error", f"{type(exc).__name__}: {exc}"))


def _wait_all(agents: list, request: str, ids: list) -> list:
    handles = [a.recv(request, ids, timeout=TIMEOUT_S) for a in agents]
    for h in handles:
        h.wait(TIMEOUT_S)
    return handles


def _check(expected: Expected, layouts: list, ids: list, request: str, *, first: bool = False) -> None:
    bad = expected.mismatch(layouts, ids, first=first)
    if bad is not None:
        raise KVXferError(f"request {request}: {bad}")


def measure(spec: dict, iters: int, warmup: int, rtt_iters: int) -> dict:
    """Run P and D, time and verify every request; raises KVXferError on a wrong byte."""
    from .. import Agent, AgentConfig
    from . import resources
    from .copy_limit import MemcpyLimit

    ctx = mp.get_context("spawn")
    d_agents, d_layouts, procs = [], [], []
    q = ctx.Queue()
    try:
        for rank in range(spec["d_tp"]):
            a = Agent(f"decode-{rank}", secret=SECRET, backend=spec["backend"],
                      config=AgentConfig.from_env(path=spec["path"]))
            d_agents.append(a)
            d_layouts.append(make_layout(spec, "d", rank, fill=False))
            a.register_kv(d_layouts[-1])
        requests = [f"req-{i}" for i in range(warmup + iters)]
        for rank in range(spec["p_tp"]):
            proc = ctx.Process(target=_prefill, daemon=True,
                               args=(spec, rank, [a.address for a in d_agents], requests, rtt_iters, q))
            proc.start()
            procs.append(proc)
        dst = block_ids(spec, 2)
        expected = Expected(spec, d_layouts, block_ids(spec, 1))  # while P starts
        transport = None
        for _ in procs:
            msg = q.get(timeout=TIMEOUT_S)
            if msg[0] != "ready":
                raise KVXferError(f"prefill process failed: {msg[1]}")
            transport = msg[2]
        nbytes = sum(layout.wire_nbytes(len(dst)) for layout in d_layouts)
        times, memcpy, limit, path = [], [], None, None
        for i, req in enumerate(requests):
            for layout in d_layouts:
                clear(layout)
            t0 = time.perf_counter()
            hs = _wait_all(d_agents, req, dst)
            elapsed = time.perf_counter() - t0
            _check(expected, d_layouts, dst, req)
            if limit is None:  # the path is known once a request moved
                path = hs[0].path
                res = resources.for_path(transport, nbytes, path=path, senders=spec["p_tp"],
                                         receivers=spec["d_tp"], shared=spec.get("memory") == "shared")
                limit = MemcpyLimit(nbytes, threads=res.threads, streaming=res.streaming)
                if not limit.check():
                    raise KVXferError("memcpy limit copied wrong bytes")
                limit.seconds(1, warmup=1)
            if i >= warmup:
                times.append(elapsed)
                memcpy.append(limit.sample())
        wins = {str(k): v for k, v in limit.wins.items()}
        del limit
        rtts = []
        import torch

        # The untimed clearing and checking between round trips are torch ops on one
        # block; with torch's intra-op threads, its OpenMP workers spin for a while after
        # each op, into the next timed round trip, on the cores the agents need (on 2
        # cores: p99 3.3-3.9 ms instead of 0.8 ms, OMP_WAIT_POLICY=passive gives the same
        # 0.8 ms). One thread does them as well, and spins nowhere.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i in range(rtt_iters):
                for layout in d_layouts:
                    clear(layout, dst[:1])
                t0 = time.perf_counter()
                _wait_all(d_agents, f"rtt-{i}", dst[:1])
                rtts.append(time.perf_counter() - t0)
                _check(expected, d_layouts, dst[:1], f"rtt-{i}", first=True)
        finally:
            torch.set_num_threads(threads)
        results = [q.get(timeout=TIMEOUT_S) for _ in procs]
        for status, info in results:
            if status != "done":
                raise KVXferError(f"prefill process failed: {info}")
        return {"spec": spec, "bytes": nbytes, "seconds": times, "memcpy_seconds": memcpy,
                "memcpy_resources": res.as_dict(), "memcpy_wins_by_threads": wins, "path": path, "transport": transport,
                "rtt_seconds": rtts, "verified_requests": len(requests) + rtt_iters,
                "sender_paths": results[0][1]["paths"], "sender_histograms": results[0][1]["metrics"]}
    finally:
        for a in d_agents:
            a.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
