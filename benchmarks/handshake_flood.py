"""Legitimate connects while a local process floods an agent's listener with
half-open connections.

The attacker (its own process) keeps ``--conns`` connections open, each with a
partial HELLO and nothing more. In ``reconnect`` mode it opens a new one as soon
as the agent closes one (REJECT, eviction or the 2 s HELLO deadline); in ``hold``
mode it opens each once; in ``churn`` mode it opens new ones as fast as it can and
closes its oldest beyond ``--conns``. It connects from ``--source`` (default 127.0.0.1, the
address every peer on this host shares). Meanwhile this process connects
``--attempts`` times as a real agent with the secret, one after the other; the
figure is how many of them got through. The agent under attack runs in a third
process.

    python benchmarks/handshake_flood.py [--mode reconnect|hold|churn] [--hello partial|full] [--conns 200] [--attempts 24]
"""
from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

SECRET = b"bench-secret-0123456789"


def server() -> None:
    from agent_procs import make_pool

    from kvxfer import Agent, AgentConfig

    with Agent("srv", secret=SECRET, backend="auto", config=AgentConfig.from_env()) as a:
        a.register_kv(make_pool("2 N B H D", None))
        print(a.address, flush=True)
        sys.stdin.readline()


def attacker(address: str, source: str, conns: int, mode: str, full_hello: bool) -> None:
    from kvxfer.agent.protocol import Msg, encode

    host, port = address.rsplit(":", 1)
    hello = encode(Msg.HELLO, nonce=b"\1" * 32)
    partial = hello if full_hello else hello[:5]
    sel = selectors.DefaultSelector()
    made = 0
    reconnect, churn = mode == "reconnect", mode == "churn"

    def report(*_) -> None:
        print(made, flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, report)

    def dial() -> None:
        nonlocal made
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.connect((host, int(port)))
            s.sendall(partial)
        except OSError:
            s.close()
            return
        s.setblocking(False)
        made += 1
        sel.register(s, selectors.EVENT_READ, made)

    for _ in range(conns):
        dial()
    print("ready", flush=True)
    t_end = time.monotonic() + 600
    while time.monotonic() < t_end:
        for key, _ in sel.select(0 if churn else 0.5):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if data:
                continue  # a REJECT or CHALLENGE; the close follows
            sel.unregister(s)
            s.close()
            if reconnect:
                dial()
        if reconnect:
            while len(sel.get_map()) < conns:
                dial()
        if churn:  # open one more at once, close the oldest
            for _ in range(64):
                dial()
            while len(sel.get_map()) > conns:
                oldest = min(sel.get_map().values(), key=lambda k: k.data)
                sel.unregister(oldest.fileobj)
                oldest.fileobj.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("reconnect", "hold", "churn"), default="reconnect")
    ap.add_argument("--conns", type=int, default=200)
    ap.add_argument("--attempts", type=int, default=24)
    ap.add_argument("--source", default="127.0.0.1")
    ap.add_argument("--hello", choices=("partial", "full"), default="partial",
                    help="what each attacking connection sends: 5 bytes of a HELLO, or a whole one")
    ap.add_argument("--role", choices=("server", "attacker"), help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "server":
        return server()
    if args.role == "attacker":
        return attacker(args.address, args.source, args.conns, args.mode, args.hello == "full")

    from agent_procs import make_pool

    from kvxfer import Agent, AgentConfig, KVXferError

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    me = os.path.abspath(__file__)
    srv = subprocess.Popen([sys.executable, me, "--role", "server"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env)
    att = None
    try:
        address = srv.stdout.readline().strip()
        att = subprocess.Popen([sys.executable, me, "--role", "attacker", "--address", address, "--source",
                                args.source, "--conns", str(args.conns), "--mode", args.mode, "--hello", args.hello],
                               stdout=subprocess.PIPE, text=True, env=env)
        assert att.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        t_start = time.monotonic()
        ok, errors, took = 0, {}, []
        for _ in range(args.attempts):
            with Agent("cli", secret=SECRET, backend="auto", config=AgentConfig.from_env()) as c:
                c.register_kv(make_pool("2 N B H D", 1))
                t0 = time.monotonic()
                try:
                    c.connect(address, timeout=5.0)
                    ok += 1
                    took.append(time.monotonic() - t0)
                except KVXferError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    print(f"  refused: {type(exc).__name__}: {exc}")
        elapsed = time.monotonic() - t_start
        att.terminate()
        made = int(att.stdout.read().split()[-1])
        att = None
        took.sort()
        median = f", median connect {took[len(took) // 2] * 1e3:.1f} ms" if took else ""
        print(f"{args.mode} flood of {args.conns} half-open connections ({args.hello} HELLO) from {args.source}, "
              f"{made / elapsed:.0f} attacking connects/s: {ok} of {args.attempts} legitimate connects got "
              f"through{median}; failed: {errors or 'none'}")
    finally:
        if att is not None:
            att.kill()
        srv.stdin.write("\n")
        srv.stdin.flush()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()


if __name__ == "__main__":
    main()
