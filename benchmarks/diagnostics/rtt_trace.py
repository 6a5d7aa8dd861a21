"""Where the 1-block round trip's time goes: timestamps on both sides of one agent pair.

Same setup as ``kvxfer bench e2e --model smollm2-135m --rtt-iters 300`` (SmolLM2 pools,
``vm`` transport, P in a spawned process with every send posted first, D timing
``recv`` -> ``wait``), with ``time.perf_counter`` marks (CLOCK_MONOTONIC, comparable
across processes on one host) wrapped around the agent's internal steps: D's ``recv``
call, P's read of RECV_POST, P's handling up to the write, the write, P's handling
after it, D's read of DATA_DONE, D's completion, D's waiting thread waking. A
diagnostic of the 1-block round trip (it patches internal methods; run it on a quiet machine)::

    PYTHONPATH=. python benchmarks/diagnostics/rtt_trace.py [--gap-us 1000]

``--gap-us``: D sleeps this long before each recv, as ``bench e2e`` spends its time
between round trips clearing and checking (both agents' threads go idle meanwhile).
"""
import multiprocessing as mp
import os
import time
from rtt_pools import pool  # noqa: E402 (benchmarks/ is on sys.path when run as a script)
SECRET = b"0123456789abcdef-rtt"
def patch(marks):
    import kvxfer.agent.io_loop as L, kvxfer.agent.sender as P, kvxfer.agent.datapath as S
    r = L.IOLoop._read
    def _read(self, conn):
        marks.append(("read", time.perf_counter())); return r(self, conn)
    L.IOLoop._read = _read
    po = P.PostMatcher.on_recv_post
    def orp(self, peer, f):
        marks.append(("post_in", time.perf_counter())); x = po(self, peer, f); marks.append(("post_out", time.perf_counter())); return x
    P.PostMatcher.on_recv_post = orp
    pw = S.Shipper._post_and_wait
    def paw(self, *a):
        marks.append(("write0", time.perf_counter())); x = pw(self, *a); marks.append(("write1", time.perf_counter())); return x
    S.Shipper._post_and_wait = paw
def prefill(addr, n, q):
    marks = []; patch(marks)
    from kvxfer import Agent, AgentConfig
    with Agent("p", secret=SECRET, config=AgentConfig.from_env(lease_timeout=600)) as p:
        p.register_kv(pool())
        peer = p.connect(addr)
        hs = [p.send(peer, f"r{i}", [1]) for i in range(n)]
        q.put("ready")
        for h in hs:
            h.wait(120)
        q.put(marks)
if __name__ == "__main__":
    from kvxfer import Agent, AgentConfig
    N = 300
    dm = []; patch(dm)
    import kvxfer.agent.receiver as R
    dl = R.Receiver._delivered
    def _del(self, *a, **k):
        dm.append(("deliv0", time.perf_counter())); x = dl(self, *a, **k); dm.append(("deliv1", time.perf_counter())); return x
    R.Receiver._delivered = _del
    d = Agent("d", secret=SECRET, config=AgentConfig.from_env())
    d.register_kv(pool())
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    pr = ctx.Process(target=prefill, args=(d.address, N, q)); pr.start()
    assert q.get(timeout=120) == "ready"
    rows = []
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--gap-us", type=float, default=0.0)
    gap = ap.parse_args().gap_us / 1e6
    for i in range(N):
        if gap:
            time.sleep(gap)
        dm.clear()
        t0 = time.perf_counter()
        h = d.recv(f"r{i}", [2], timeout=30)
        t1 = time.perf_counter()
        h.wait(30)
        t2 = time.perf_counter()
        rows.append((t0, t1, t2, list(dm)))
    pm = q.get(timeout=120); pr.join(30); d.close()
    ps = list(pm)
    res = {k: [] for k in ["recv_call", "to_P_read", "P_handle_before_write", "write", "P_after_write", "to_D_read", "D_read_to_deliv_end", "wake_main", "total"]}
    for t0, t1, t2, dmk in rows[30:]:
        # find P marks in window
        win = [m for m in ps if t0 <= m[1] <= t2]
        d = dict()
        for k, t in win:
            d.setdefault(k, t)
        dd = {}
        for k, t in dmk:
            dd.setdefault(k, t)
        if not all(k in d for k in ("read", "post_in", "write0", "write1")) or "deliv1" not in dd:
            continue
        after = [t for k, t in ps if k == "post_out" and t > d["write1"]]  # may end after t2
        if not after:
            continue
        dread = [t for k, t in dmk if k == "read" and t > d["write1"]]
        if not dread: continue
        res["recv_call"].append(t1 - t0)
        res["to_P_read"].append(d["read"] - t1)
        res["P_handle_before_write"].append(d["write0"] - d["read"])
        res["write"].append(d["write1"] - d["write0"])
        # P's marks in the window start with the previous trip's tail (its handling goes
        # on after D has its data): this trip's RECV_POST handling ends after its write
        res["P_after_write"].append(after[0] - d["write1"])
        res["to_D_read"].append(dread[0] - d["write1"])
        res["D_read_to_deliv_end"].append(dd["deliv1"] - dread[0])
        res["wake_main"].append(t2 - dd["deliv1"])
        res["total"].append(t2 - t0)
    print("load", os.getloadavg()[0], "samples", len(res["total"]), "gap_us", gap * 1e6)
    for k, v in res.items():
        v.sort()
        print("%-24s p50 %7.0f us" % (k, v[len(v)//2] * 1e6))
