"""CPU and garbage collection per 1-block round trip, per thread, P in its own process.

The setup of ``benchmarks/diagnostics/rtt_trace.py`` (SmolLM2 pools, ``vm``, every send posted
first, D timing ``recv`` -> ``wait`` back to back), 2,900 timed trips after 100
warm-up ones: user and system CPU of each agent thread per trip (from
``/proc/self/task/*/stat``, 10 ms ticks over ~1 s of CPU), the cyclic garbage
collector's runs per generation on each side (``gc.callbacks``), and the round
trip's p50/p99. A diagnostic of the 1-block round trip (less CPU per trip is what the
round trip gains on a loaded machine)::

    PYTHONPATH=. python benchmarks/diagnostics/rtt_cpu.py
"""
import multiprocessing as mp, os, sys, time, threading, gc
SECRET = b"0123456789abcdef-rtt"
GCT = {}
_t = [0.0]
def _cb(phase, info):
    if phase == "start": _t[0] = time.perf_counter()
    else:
        g = GCT.setdefault(info["generation"], [0, 0.0]); g[0] += 1; g[1] += (time.perf_counter() - _t[0]) * 1e3
gc.callbacks.append(_cb)
from rtt_pools import pool  # noqa: E402 (benchmarks/ is on sys.path when run as a script)
def clocks():
    out = {}
    for t in threading.enumerate():
        f = open(f"/proc/self/task/{t.native_id}/stat").read().rsplit(")", 1)[1].split()
        out[t.name + ".u"] = int(f[11]) / os.sysconf("SC_CLK_TCK")
        out[t.name + ".s"] = int(f[12]) / os.sysconf("SC_CLK_TCK")
    return out
def prefill(addr, n, q, back, ev):
    from kvxfer import Agent, AgentConfig
    with Agent("p", secret=SECRET, config=AgentConfig.from_env(lease_timeout=600)) as p:
        p.register_kv(pool())
        peer = p.connect(addr)
        hs = [p.send(peer, f"r{i}", [1]) for i in range(n)]
        q.put("ready")
        ev.wait(); c0 = clocks(); GCT.clear(); q.put("go")
        back.get(); c1 = clocks()
        q.put(({k: c1[k] - c0[k] for k in c1 if k in c0}, dict(GCT)))
        for h in hs: h.wait(120)
if __name__ == "__main__":
    sys.path.insert(0, ".")
    from kvxfer import Agent, AgentConfig
    N, W = int(os.environ.get("N", "3000")), 100
    d = Agent("d", secret=SECRET, config=AgentConfig.from_env()); d.register_kv(pool())
    ctx = mp.get_context("spawn"); q = ctx.Queue(); back = ctx.Queue(); ev = ctx.Event()
    pr = ctx.Process(target=prefill, args=(d.address, N, q, back, ev)); pr.start()
    assert q.get(timeout=120) == "ready"
    for i in range(W):
        d.recv(f"r{i}", [2], timeout=30).wait(30)
    ev.set(); assert q.get(timeout=60) == "go"
    c0 = clocks(); ts = []; GCT.clear()
    for i in range(W, N):
        t0 = time.perf_counter(); d.recv(f"r{i}", [2], timeout=30).wait(30); ts.append(time.perf_counter() - t0)
    c1 = clocks(); dg = dict(GCT); back.put("stop"); pc, pg = q.get(timeout=60)
    pr.join(60); d.close()
    n = N - W; ts.sort()
    row = {"D " + k: (c1[k] - c0[k]) / n * 1e6 for k in c1 if k in c0}
    row.update({"P " + k: v / n * 1e6 for k, v in pc.items()})
    row = {k: v for k, v in row.items() if v > 0.5}
    print(" ".join(f"{k}={v:.0f}" for k, v in row.items()), f"CPU={sum(row.values()):.0f}us",
          f"p50={ts[n//2]*1e6:.0f} p99={ts[int(n*.99)]*1e6:.0f} load={os.getloadavg()[0]:.2f}")
    fmt = lambda g: " ".join(f"gen{k}: {c} in {ms:.0f} ms" for k, (c, ms) in sorted(g.items()))
    print(f"  GC over {n} trips  D: {fmt(dg)}  |  P: {fmt(pg)}")
