"""RSS of an agent (P, the victim, its own process) while one authenticated peer (D)
floods it with RECV_POSTs it must refuse.

Each post names ``--ids`` block ids, all outside D's advertised pool, so P refuses it
(``InvalidDescriptor``), answers FAIL and keeps a tombstone for a later send of that
id. What P may keep of it is bounded (``PeerLimits.max_tombstone_bytes`` per peer,
``max_agent_tombstone_bytes`` in all); before that bound, each tombstone held the
exception, its traceback and the decoded block list.

    python benchmarks/post_flood.py [--posts 200] [--ids 400000]

Prints P's RSS at its start (agent up, pool registered, D connected), after the
flood (P has processed every post: a real recv D posts after the flood completes),
and after D disconnected; the figure to read is ``flood - start``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

SECRET = b"bench-secret-0123456789"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def victim() -> None:
    """P: listen, serve one send of "done", then wait for D to go."""
    from agent_procs import make_pool

    from kvxfer import Agent, AgentConfig

    p = Agent("victim", secret=SECRET, backend="auto", config=AgentConfig.from_env())
    p.register_kv(make_pool("2 N B H D", 1))
    print(p.address, flush=True)
    h = p.send(None, "done", [5, 6])
    h.wait(600)
    print("served", flush=True)
    sys.stdin.readline()  # D disconnected
    deadline = time.monotonic() + 60
    while p.peers() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("alone", flush=True)
    sys.stdin.readline()
    p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--posts", type=int, default=200)
    ap.add_argument("--ids", type=int, default=400_000)
    ap.add_argument("--victim", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.victim:
        return victim()

    from agent_procs import make_pool

    from kvxfer import Agent, AgentConfig
    from kvxfer.agent.protocol import Msg, encode

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--victim"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = proc.stdout.readline().strip()
        d = Agent("flood", secret=SECRET, backend="auto", config=AgentConfig.from_env())
        d.register_kv(make_pool("2 N B H D", None))
        peer = d.connect(address, timeout=30)
        time.sleep(0.5)
        start = rss_mb(proc.pid)
        blocks = list(range(args.ids))  # all but the first 32 outside D's pool: refused
        t0 = time.monotonic()
        peak = start
        for i in range(args.posts):
            frame = encode(Msg.RECV_POST, req=f"flood-{i}", xid=i + 1, blocks=blocks, layers=[0, 1, 2, 3],
                           heads=(0, 4), skip=0)
            while len(peer.conn._out) > 8 << 20:  # the control connection drops a peer past 64 MiB queued
                time.sleep(0.001)
            if not peer.conn.send(frame):
                raise SystemExit("the victim dropped the flooding peer")
            if i % 10 == 0:
                peak = max(peak, rss_mb(proc.pid))
        h = d.recv("done", [3, 4], timeout=600)  # behind every flood post on the same connection
        h.wait(600)
        flooded = time.monotonic() - t0
        assert proc.stdout.readline().strip() == "served"
        after_flood = rss_mb(proc.pid)
        peak = max(peak, after_flood)
        d.close()
        proc.stdin.write("gone\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "alone"
        time.sleep(0.5)
        after_close = rss_mb(proc.pid)
        print(f"{args.posts} refused posts of {args.ids} ids in {flooded:.1f} s")
        print(f"victim RSS: start {start:.0f} MB, after flood {after_flood:.0f} MB (+{after_flood - start:.0f}), "
              f"peak {peak:.0f} MB, after the peer left {after_close:.0f} MB (+{after_close - start:.0f})")
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    main()
