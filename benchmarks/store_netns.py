"""The KV store across two network namespaces over TCP, against iperf3 on the same link.

Two namespaces joined by a veth pair: a ``kvxfer store`` node in one, the client in the
other (``KVStore.put``/``get`` of ``--batch`` 2 MiB objects from an NHD pool, checksums on,
UCX's TCP transport). Interleaved per repetition: iperf3 (native TCP, one stream, 128 KiB
writes), then the store's put and get, then iperf3 again; each repetition's ratio uses the
mean of the iperf3 runs just before and after it. Every get is checked bitwise against
what was put. Each repetition also times 500 lookups of a chain twice the batch long (the
first half present): from the other namespace they go to the node's backend over TCP.
The client runs with ``OMP_WAIT_POLICY=PASSIVE``, so that the torch calls that check and
clear its pool leave no OpenMP worker spinning beside the timed calls (``--omp-spin``:
leave it as the environment has it, to see what that costs).
Needs root, iproute2 and iperf3 (Debian: ``apt-get install -y iperf3``).

    PYTHONPATH=$PWD python benchmarks/store_netns.py --json benchmarks/results/store_netns.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NL, BS, NH, HD = 32, 16, 8, 128
OBJ = NL * 2 * BS * NH * HD * 2  # 2 MiB
SECRET = "store-netns-benchmark-secret-0123456789"


def client(addr: str, batch: int, iters: int, salt: str, checksum: bool, lookups: int = 500) -> None:
    """In the client namespace: ``iters`` put+get rounds, then ``lookups`` lookups of a
    ``2 * batch``-key chain (the first ``batch`` present); one JSON line of seconds."""
    import torch

    import kvxfer

    def pool(seed):
        g = torch.Generator().manual_seed(seed)
        return kvxfer.KVLayout.from_tensors(
            [torch.randint(-2**15, 2**15, (2, batch, BS, NH, HD), dtype=torch.int16, generator=g).view(torch.bfloat16)
             for _ in range(NL)], "2 N B H D")

    src, dst = pool(1), pool(2)
    out = {"put_s": [], "get_s": []}
    # UCX only: namespaces made by `ip netns` share the host's boot id, hostname and pid
    # namespace, which the default backend would take for one host (its vm path)
    with kvxfer.KVStore(nodes=[addr], secret=SECRET.encode(), staging_bytes=batch * OBJ, timeout=60.0,
                        checksum=checksum, backend="ucx") as st:
        for it in range(iters + 1):  # one warm-up round
            keys = kvxfer.block_keys(range(BS * batch), BS, salt=f"{salt}-{it}".encode())
            t0 = time.perf_counter()
            st.put(keys, src, range(batch)).wait(timeout=300)
            t1 = time.perf_counter()
            st.get(keys, dst, range(batch)).wait(timeout=300)
            t2 = time.perf_counter()
            if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(src.tensors, dst.tensors)):
                raise SystemExit("a get returned bytes that differ from the put")
            for t in dst.tensors:
                t.zero_()
            if it:
                out["put_s"].append(t1 - t0)
                out["get_s"].append(t2 - t1)
        out["transport"] = st._conns[addr].bconn.transport
        # lookups of a chain whose first `batch` keys are present, as from another host
        chain = keys + kvxfer.block_keys(range(BS * batch, 2 * BS * batch), BS, salt=b"absent")
        asked = dict(st.counters)
        lat = []
        for _ in range(lookups):
            t = time.perf_counter()
            if st.lookup(chain) != batch:
                raise SystemExit("a lookup did not find the keys just put")
            lat.append(time.perf_counter() - t)
        lat.sort()
        out["lookup_us"] = [lat[len(lat) // 2] * 1e6, lat[int(len(lat) * 0.99)] * 1e6]
        out["lookup_paths"] = {k: st.counters[k] - asked[k] for k in ("lookup_table_reads", "lookup_requests",
                                                                       "lookup_backend_messages")}
    if not out["transport"].startswith("ucx:tcp"):
        raise SystemExit(f"the store's bytes went over {out['transport']}, not TCP")
    print(json.dumps(out), flush=True)


class Link:
    """Two namespaces ``a`` (client) and ``b`` (node) on one veth pair."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.a, self.b = f"kvxsa{tag}", f"kvxsb{tag}"
        self.ip_a, self.ip_b = f"10.89.{tag % 200}.1", f"10.89.{tag % 200}.2"
        self.made: list = []

    def __enter__(self) -> "Link":
        ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
        for ns in (self.a, self.b):
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        va, vb = f"vsa{os.getpid() % 100000}", f"vsb{os.getpid() % 100000}"
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", self.a)
        ip("link", "set", vb, "netns", self.b)
        ip("-n", self.a, "addr", "add", f"{self.ip_a}/24", "dev", va)
        ip("-n", self.b, "addr", "add", f"{self.ip_b}/24", "dev", vb)
        ip("-n", self.a, "link", "set", va, "up")
        ip("-n", self.b, "link", "set", vb, "up")
        time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def run(self, ns: str, argv, **kw):
        return subprocess.run(["ip", "netns", "exec", ns, *argv], **kw)

    def popen(self, ns: str, argv, **kw):
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], start_new_session=True, **kw)


def iperf(link: Link, seconds: float) -> float:
    """Native TCP a -> b over the veth, one stream, 128 KiB writes: bytes/s."""
    server = link.popen(link.b, ["iperf3", "-s", "-1", "-B", link.ip_b, "-p", "5201"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):  # until the server listens
            if link.run(link.b, ["ss", "-ltnH", "sport = :5201"], capture_output=True, text=True).stdout.strip():
                break
            time.sleep(0.1)
        out = link.run(link.a, ["iperf3", "-c", link.ip_b, "-p", "5201", "-t", str(seconds), "-l", "128K", "-J"],
                       capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"iperf3 failed: {out.stdout[-500:]}")
        return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="objects per put/get call")
    ap.add_argument("--iters", type=int, default=8, help="put+get rounds per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iperf-s", type=float, default=3.0)
    ap.add_argument("--no-checksum", action="store_true", help="objects without checksums (what they cost)")
    ap.add_argument("--omp-spin", action="store_true",
                    help="leave the client's OpenMP wait policy as the environment has it (by default libgomp's "
                         "worker spins beside the timed calls: what that costs)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--client", nargs=2, metavar=("ADDR", "SALT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client(args.client[0], args.batch, args.iters, args.client[1], not args.no_checksum)
        return
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iperf3") is None:
        raise SystemExit("needs root, iproute2 and iperf3 (apt-get install -y iperf3)")
    # OMP_WAIT_POLICY=PASSIVE: the client checks every get with torch and zeroes the pool
    # before the next put; torch's OpenMP worker (libgomp) would otherwise spin for ~10 ms of
    # CPU after each of those calls, on one of the cores the timed put needs (measured here:
    # puts at 0.5-0.8x iperf3 with it spinning, 0.85-1.2x without)
    env = {**os.environ, "KVXFER_SECRET": SECRET, "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    if not args.omp_spin:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    nbytes = args.batch * OBJ
    capacity = 2 * (args.iters + 1) * args.reps * nbytes  # every object the run puts: no eviction
    with Link() as link:
        node = link.popen(link.b, [sys.executable, "-m", "kvxfer.cli", "store", "--listen", f"{link.ip_b}:7600",
                                   "--capacity", str(capacity), "--slot-size", str(OBJ), "--log-level", "warning"],
                          env=env, stdout=subprocess.PIPE, text=True)
        if not node.stdout.readline().startswith("kvxfer store listening on "):
            raise SystemExit("the store node did not start")
        reps = []
        before = iperf(link, args.iperf_s)
        for r in range(args.reps):
            out = link.run(link.a, [sys.executable, os.path.abspath(__file__), "--batch", str(args.batch), "--iters",
                                    str(args.iters), "--client", f"{link.ip_b}:7600", f"rep{r}",
                                    *(["--no-checksum"] if args.no_checksum else [])],
                           env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise SystemExit(f"client failed: {out.stderr[-2000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            after = iperf(link, args.iperf_s)
            tcp = (before + after) / 2
            put = nbytes / statistics.median(got["put_s"])
            get = nbytes / statistics.median(got["get_s"])
            reps.append({"iperf3_gbps": tcp / 1e9, "put_gbps": put / 1e9, "get_gbps": get / 1e9,
                         "put_vs_iperf3": put / tcp, "get_vs_iperf3": get / tcp, "transport": got["transport"],
                         "put_ms": [round(s * 1e3, 2) for s in got["put_s"]],
                         "get_ms": [round(s * 1e3, 2) for s in got["get_s"]],
                         "lookup_p50_us": got["lookup_us"][0], "lookup_p99_us": got["lookup_us"][1],
                         "lookup_paths": got["lookup_paths"]})
            print(json.dumps(reps[-1]), flush=True)
            before = after
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=30)
    result = {"object_bytes": OBJ, "objects_per_call": args.batch, "iters": args.iters, "reps": reps,
              "put_vs_iperf3_median": statistics.median(r["put_vs_iperf3"] for r in reps),
              "get_vs_iperf3_median": statistics.median(r["get_vs_iperf3"] for r in reps),
              "lookup_p50_us_median": statistics.median(r["lookup_p50_us"] for r in reps),
              "checksums": not args.no_checksum, "omp_wait_policy": env.get("OMP_WAIT_POLICY"),
              "load_average": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
