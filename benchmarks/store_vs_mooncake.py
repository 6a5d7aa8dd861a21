"""kvxfer's KV store side by side with Mooncake Store, on one host, in one run.

Both pools hold 2 MiB objects (one block of a 32-layer, 8-kv-head, head-dim-128, bf16
model, 16 tokens a block) and are driven from their own client process, one operation at
a time, alternating, with the memcpy limit of the same bytes sampled between them:

- kvxfer: one ``kvxfer store`` node process; ``KVStore.put``/``get`` of ``--batch`` blocks
  of an NHD pool (each object gathered from 64 tiles of 32 KiB, straight into the node's
  slots), with checksums on (the default) and off; ``lookup`` of a 64-key chain (16 keys
  present), answered from the node's key table in shared memory (the same-host path), and
  the same lookup by a client process on UCX over TCP only (``UCX_TLS=tcp``), whose lookup
  the node's backend answers from that table (the path from another host).
- Mooncake Store (``mooncake-transfer-engine-non-cuda``, ``make bench-mooncake`` installs
  it): ``mooncake_master`` with its HTTP metadata server, a process that mounts the
  segment, and the client (no segment of its own) using its zero-copy calls
  (``register_buffer``, ``batch_put_from``, ``batch_get_into``) on one contiguous
  registered 2 MiB buffer per object (easier than kvxfer's gathered tiles);
  ``batch_is_exist`` of 64 keys. ``--mooncake-local`` mounts the segment in the client
  itself instead (its same-host best: no second process in the path).

Every timed get is checked bitwise against what was put (outside the timing); the client
processes run with ``OMP_WAIT_POLICY=PASSIVE``, so that those torch checks leave no OpenMP
worker spinning beside the next timed call. GB/s is the median over ``--iters``; lookups
are p50/p99 of ``--lookups`` samples, back to back or with ``--lookup-gap-ms`` idle before
each (every path alike).

    make bench-mooncake          # installs the wheel and runs this with --json
    PYTHONPATH=$PWD python benchmarks/store_vs_mooncake.py --json benchmarks/results/store_vs_mooncake.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NL, BS, NH, HD = 32, 16, 8, 128
OBJ = NL * 2 * BS * NH * HD * 2  # 2 MiB
CHAIN = 64


# ---- the client processes: one command a line on stdin, one JSON line back -------------------------


def time_lookups(st, chain, n: int, batch: int, gap_s: float = 0.0) -> dict:
    """``n`` timed ``st.lookup(chain)`` (seconds each; ``gap_s`` idle before each), whether
    the last found ``batch`` keys, and the lookup paths they took (the client's counters)."""
    before = dict(st.counters)
    lat = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        found = st.lookup(chain)
        lat.append(time.perf_counter() - t)
    return {"lookup_s": lat, "ok": found == batch, "found": found,
            **{k: st.counters[k] - before[k] for k in ("lookup_table_reads", "lookup_requests",
                                                       "lookup_backend_messages")}}


def kvxfer_remote_client(addr: str, secret: str, batch: int) -> None:
    """Lookups as from another host: a client on UCX only (started with ``UCX_TLS=tcp``),
    whose lookups go to the node's backend over TCP."""
    import kvxfer

    chain = kvxfer.block_keys(range(BS * CHAIN), BS, salt=b"lookup")
    with kvxfer.KVStore(nodes=[addr], secret=secret.encode(), staging_bytes=OBJ, timeout=30.0, backend="ucx") as st:
        deadline = time.monotonic() + 60
        while st.lookup(chain) != batch:  # the other client puts the chain's first keys
            if time.monotonic() > deadline:
                raise SystemExit("the chain never appeared in the pool")
            time.sleep(0.1)
        transport = st._conns[addr].bconn.transport
        for line in sys.stdin:
            _, arg, gap = line.split()
            print(json.dumps({**time_lookups(st, chain, int(arg), batch, float(gap)), "transport": transport}),
                  flush=True)


def kvxfer_client(addr: str, secret: str, batch: int) -> None:
    import torch

    import kvxfer

    def pool(seed):
        g = torch.Generator().manual_seed(seed)
        return kvxfer.KVLayout.from_tensors(
            [torch.randint(-2**15, 2**15, (2, batch, BS, NH, HD), dtype=torch.int16, generator=g).view(torch.bfloat16)
             for _ in range(NL)], "2 N B H D")

    src, dst = pool(1), pool(2)
    stores = {crc: kvxfer.KVStore(nodes=[addr], secret=secret.encode(), staging_bytes=batch * OBJ, timeout=30.0,
                                  checksum=crc) for crc in (True, False)}
    chain = kvxfer.block_keys(range(BS * CHAIN), BS, salt=b"lookup")
    stores[True].put(chain[:batch], src, range(batch)).wait(timeout=120)
    for line in sys.stdin:
        cmd, arg, *gap = line.split()
        if cmd == "putget":
            st = stores[arg.endswith("crc")]
            keys = kvxfer.block_keys(range(BS * batch), BS, salt=arg.encode())
            t0 = time.perf_counter()
            st.put(keys, src, range(batch)).wait(timeout=120)
            t1 = time.perf_counter()
            st.get(keys, dst, range(batch)).wait(timeout=120)
            t2 = time.perf_counter()
            ok = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(src.tensors, dst.tensors))
            for t in dst.tensors:
                t.zero_()
            reply = {"put_s": t1 - t0, "get_s": t2 - t1, "ok": ok}
        else:  # lookup N: read the node's key table (the same-host path)
            reply = time_lookups(stores[True], chain, int(arg), batch, float(gap[0]))
        print(json.dumps(reply), flush=True)
    for st in stores.values():
        st.close()


def _mooncake_setup(segment: int, local_buffer: int):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "http://127.0.0.1:18080/metadata", segment, local_buffer, "tcp", "",
                 "127.0.0.1:50051")
    if rc != 0:
        raise SystemExit(f"mooncake setup failed: {rc}")
    return s


def mooncake_holder(segment: int) -> None:
    s = _mooncake_setup(segment, 16 << 20)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes it
    s.close()


def mooncake_client(batch: int, segment: int) -> None:
    import numpy as np

    s = _mooncake_setup(segment, 64 << 20)
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, batch * OBJ, dtype=np.uint8)
    dst = np.zeros_like(src)
    for buf in (src, dst):
        if s.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise SystemExit("mooncake register_buffer failed")
    sp = [src.ctypes.data + i * OBJ for i in range(batch)]
    dp = [dst.ctypes.data + i * OBJ for i in range(batch)]
    chain = [f"lookup-{i}" for i in range(CHAIN)]
    if any(r != 0 for r in s.batch_put_from(chain[:batch], sp, [OBJ] * batch)):
        raise SystemExit("mooncake put of the lookup chain failed")
    for line in sys.stdin:
        cmd, arg, *gap = line.split()
        if cmd == "putget":
            keys = [f"{arg}-{i}" for i in range(batch)]
            t0 = time.perf_counter()
            put = s.batch_put_from(keys, sp, [OBJ] * batch)
            t1 = time.perf_counter()
            got = s.batch_get_into(keys, dp, [OBJ] * batch)
            t2 = time.perf_counter()
            ok = all(r == 0 for r in put) and all(r == OBJ for r in got) and np.array_equal(src, dst)
            dst[:] = 0
            s.batch_remove(keys)
            reply = {"put_s": t1 - t0, "get_s": t2 - t1, "ok": bool(ok), "put": list(put), "got": list(got)}
        else:
            lat = []
            for _ in range(int(arg)):
                if float(gap[0]):
                    time.sleep(float(gap[0]))
                t = time.perf_counter()
                r = s.batch_is_exist(chain)
                lat.append(time.perf_counter() - t)
            reply = {"lookup_s": lat, "ok": sum(1 for x in r if x == 1) == batch, "found": list(r)}
        print(json.dumps(reply), flush=True)
    s.close()


# ---- the parent: start everything, alternate, report ------------------------------------------------


class Child:
    def __init__(self, argv, env=None, stderr=subprocess.DEVNULL):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                     text=True, env=env, start_new_session=True)

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise SystemExit(f"{self.proc.args[:4]} exited with {self.proc.wait()}")
        out = json.loads(reply)
        if not out["ok"]:
            raise SystemExit(f"{self.proc.args[5:7]} {line}: failed verification ({out})")
        return out

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _wait_port(port: int, timeout: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"mooncake_master is not listening on port {port}") from None
            time.sleep(0.1)


def mooncake_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None:
        raise SystemExit("mooncake is not installed: `make bench-mooncake` installs "
                         "mooncake-transfer-engine-non-cuda==0.3.13.post1 (and Debian's libibverbs1, "
                         "libnl-3-200, libnl-route-3-200)")
    return spec.submodule_search_locations[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="objects per put/get call")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--lookup-gap-ms", type=float, default=0.0,
                    help="idle time before each lookup (0: back to back; the nodes and the master stay awake)")
    ap.add_argument("--mooncake-local", action="store_true", help="the Mooncake client mounts the segment itself")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        role, *rest = args.child
        if role == "kvxfer":
            kvxfer_client(rest[0], os.environ["KVXFER_SECRET"], args.batch)
        elif role == "kvxfer-remote":
            kvxfer_remote_client(rest[0], os.environ["KVXFER_SECRET"], args.batch)
        elif role == "holder":
            mooncake_holder(int(rest[0]))
        else:
            mooncake_client(args.batch, int(rest[0]))
        return

    sys.path.insert(0, HERE)
    from store_hit_ratio import SECRET, start_nodes, stop_nodes

    from kvxfer.bench.copy_limit import MemcpyLimit

    mc = mooncake_dir()
    # OMP_WAIT_POLICY=PASSIVE: the kvxfer client checks every get with torch and zeroes its
    # pool; torch's OpenMP worker would otherwise spin for ~10 ms beside the next timed put
    # (here the checksums-off one, which then ran at 7-10 GB/s against 13 with it passive)
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([mc, os.environ.get("LD_LIBRARY_PATH", "")]),
           "KVXFER_SECRET": SECRET, "OMP_WAIT_POLICY": "PASSIVE"}
    nbytes = args.batch * OBJ
    # room for every object the run puts (Mooncake's removes may lag behind its leases), no eviction
    segment = (args.iters + 3) * nbytes + CHAIN * OBJ
    me = [sys.executable, os.path.abspath(__file__), "--batch", str(args.batch), "--child"]
    master = subprocess.Popen([os.path.join(mc, "mooncake_master"), "--rpc_port=50051",
                               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                               "--http_metadata_server_port=18080"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    nodes, children = [], []
    try:
        _wait_port(50051)
        _wait_port(18080)
        holder = None
        if not args.mooncake_local:
            holder = Child([*me, "holder", str(segment)], env)
            children.append(holder)
            line = "?"
            while line and line.strip() != "ready":
                line = holder.proc.stdout.readline()
            if not line:
                raise SystemExit(f"the Mooncake segment process exited with {holder.proc.wait()}")
        nodes = start_nodes(1, str(2 * segment), str(OBJ))
        kv = Child([*me, "kvxfer", nodes[0][1]], env)
        remote = Child([*me, "kvxfer-remote", nodes[0][1]], {**env, "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"})
        moon = Child([*me, "mooncake", str(segment if args.mooncake_local else 0)], env)
        children += [kv, remote, moon]
        lookups = {"kvxfer": [], "kvxfer_remote": [], "mooncake": []}
        paths = {"kvxfer": [0, 0, 0], "kvxfer_remote": [0, 0, 0]}  # [key table reads, socket requests, backend messages]
        gap = args.lookup_gap_ms / 1e3
        for _ in range(10):  # alternating blocks of lookups, before the puts fill the pools
            for name, child in (("kvxfer", kv), ("kvxfer_remote", remote)):
                r = child.ask(f"lookup {args.lookups // 10} {gap}")  # (ask checks that it found the 16)
                lookups[name] += r["lookup_s"]
                paths[name][0] += r["lookup_table_reads"]
                paths[name][1] += r["lookup_requests"]
                paths[name][2] += r.get("lookup_backend_messages", 0)
                if name == "kvxfer_remote":
                    if not r["transport"].startswith("ucx:tcp"):
                        raise SystemExit(f"the remote client's lookups went over {r['transport']}, not TCP")
                    remote_transport = r["transport"]
            lookups["mooncake"] += moon.ask(f"lookup {args.lookups // 10} {gap}")["lookup_s"]
        limit = MemcpyLimit(nbytes, threads=1, streaming=True)  # the checksummed paths stream their stores
        samples = {k: [] for k in ("memcpy", "kvxfer_put_crc", "kvxfer_get_crc", "kvxfer_put_nocrc",
                                   "kvxfer_get_nocrc", "mooncake_put", "mooncake_get")}
        for it in range(args.iters + 2):  # two warm-up rounds
            mem = limit.sample()
            rounds = {"kvxfer_%s_crc": kv.ask(f"putget it{it}-crc"), "kvxfer_%s_nocrc": kv.ask(f"putget it{it}-nocrc"),
                      "mooncake_%s": moon.ask(f"putget it{it}")}
            if it >= 2:
                samples["memcpy"].append(mem)
                for pattern, r in rounds.items():
                    samples[pattern % "put"].append(r["put_s"])
                    samples[pattern % "get"].append(r["get_s"])
    finally:
        for c in children:
            c.stop()
        if nodes:
            stop_nodes(nodes)
        os.killpg(master.pid, signal.SIGTERM)
        master.wait(timeout=30)
    out = {"object_bytes": OBJ, "objects_per_call": args.batch, "iters": args.iters,
           "mooncake_segment": "client" if args.mooncake_local else "own process", "lookup_gap_ms": args.lookup_gap_ms,
           "load_average": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d"),
           "omp_wait_policy": env["OMP_WAIT_POLICY"]}
    for name, sec in samples.items():
        out[f"{name}_gbps"] = nbytes / statistics.median(sec) / 1e9
    for name in samples:
        if name != "memcpy":
            out[f"{name}_vs_memcpy"] = out[f"{name}_gbps"] / out["memcpy_gbps"]
    for op in ("put", "get"):
        for crc in ("crc", "nocrc"):
            out[f"{op}_{crc}_vs_mooncake"] = out[f"kvxfer_{op}_{crc}_gbps"] / out[f"mooncake_{op}_gbps"]
    for name, lat in lookups.items():
        lat.sort()
        out[f"{name}_lookup_p50_us"] = lat[len(lat) // 2] * 1e6
        out[f"{name}_lookup_p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
    out["lookup_p50_vs_mooncake"] = out["kvxfer_lookup_p50_us"] / out["mooncake_lookup_p50_us"]
    out["lookup_remote_p50_vs_mooncake"] = out["kvxfer_remote_lookup_p50_us"] / out["mooncake_lookup_p50_us"]
    out["kvxfer_remote_transport"] = remote_transport
    for name, (reads, requests, messages) in paths.items():
        out[f"{name}_lookup_table_reads"], out[f"{name}_lookup_requests"] = reads, requests
        out[f"{name}_lookup_backend_messages"] = messages
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
