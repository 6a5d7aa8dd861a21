"""What the I/O loop's busy-polling (``AgentConfig.loop_spin_s``) costs in CPU.

The setup of ``benchmarks/diagnostics/rtt_trace.py`` (SmolLM2 pools, ``vm``, P in a spawned process
with every send posted first), D timing ``recv`` -> ``wait`` with ``--gap-us`` of sleep
between round trips (as ``bench e2e`` spends ~0.5 ms clearing and checking). Reported,
per thread of both agents (``/proc/self/task/*/schedstat``, ns): CPU per round trip,
then CPU over ``--idle-s`` of no traffic while P still holds pending sends (the window
must close: an idle agent does not spin). Set the knob through the environment::

    KVXFER_LOOP_SPIN_S=0 PYTHONPATH=. python benchmarks/diagnostics/spin_cpu.py
    PYTHONPATH=. python benchmarks/diagnostics/spin_cpu.py            # the default window
"""
import argparse
import multiprocessing as mp
import os
import threading
import time

from rtt_pools import pool  # benchmarks/ is on sys.path when run as a script

SECRET = b"0123456789abcdef-spin"


def clocks():
    """CPU seconds so far of each live thread, by name."""
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                out[t.name] = int(f.read().split()[0]) * 1e-9
        except OSError:
            pass
    return out


def delta(c0, c1):
    return {k: c1[k] - c0[k] for k in c1 if k in c0}


def prefill(addr, n, q, back):
    from kvxfer import Agent, AgentConfig
    with Agent("p", secret=SECRET, config=AgentConfig.from_env(lease_timeout=600)) as p:
        p.register_kv(pool())
        peer = p.connect(addr)
        hs = [p.send(peer, f"r{i}", [1]) for i in range(n + 1)]  # the last one stays pending
        q.put("ready")
        while back.get() == "clocks":
            q.put(clocks())
        hs[-1].cancel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trips", type=int, default=1000)
    ap.add_argument("--gap-us", type=float, default=500.0)
    ap.add_argument("--idle-s", type=float, default=1.0)
    args = ap.parse_args()
    from kvxfer import Agent, AgentConfig
    d = Agent("d", secret=SECRET, config=AgentConfig.from_env())
    d.register_kv(pool())
    w = 50
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    pr = ctx.Process(target=prefill, args=(d.address, w + args.trips, q, back))
    pr.start()
    assert q.get(timeout=120) == "ready"
    for i in range(w):
        d.recv(f"r{i}", [2], timeout=30).wait(30)

    def both():
        back.put("clocks")
        return clocks(), q.get(timeout=60)

    d0, p0 = both()
    ts = []
    for i in range(w, w + args.trips):
        time.sleep(args.gap_us * 1e-6)
        t0 = time.perf_counter()
        d.recv(f"r{i}", [2], timeout=30).wait(30)
        ts.append(time.perf_counter() - t0)
    d1, p1 = both()
    time.sleep(args.idle_s)
    d2, p2 = both()
    back.put("stop")
    pr.join(60)
    d.close()
    ts.sort()
    n = len(ts)
    spin = d.config.loop_spin_s
    trip = {"D " + k: v for k, v in delta(d0, d1).items()} | {"P " + k: v for k, v in delta(p0, p1).items()}
    idle = {"D " + k: v for k, v in delta(d1, d2).items()} | {"P " + k: v for k, v in delta(p1, p2).items()}
    print(f"loop_spin_s={spin} gap={args.gap_us:.0f}us trips={n} p50={ts[n // 2] * 1e6:.0f}us "
          f"p99={ts[int(n * .99)] * 1e6:.0f}us load={os.getloadavg()[0]:.2f}")
    print("  CPU per trip (us): " + " ".join(f"{k}={v / n * 1e6:.0f}" for k, v in trip.items() if v / n > 5e-7)
          + f"  total={sum(trip.values()) / n * 1e6:.0f}")
    print(f"  CPU over {args.idle_s:.1f} s idle, a send pending (ms): "
          + " ".join(f"{k}={v * 1e3:.2f}" for k, v in idle.items()) + f"  total={sum(idle.values()) * 1e3:.2f}")


if __name__ == "__main__":
    main()
