"""The store's disk tier against the disk it sits on, in one run, in one directory.

Yardstick: ``dd`` moving the same bytes sequentially with O_DIRECT, 4 MiB a block, in the
same directory: ``oflag=direct`` writing a new file before and after the write-back run
(their mean), ``iflag=direct`` reading a file of the same size right before each
repetition of the gets (each repetition's ratio is against its own read; the median is
reported).

1. **write-back**: one ``kvxfer store`` node process (DRAM ``--dram``, a disk tier in a
   fresh directory) takes puts of ``--bytes`` MiB of 2 MiB objects (one block of a
   32-layer, 8-kv-head, head-dim-128 bf16 model, 16 tokens a block) from a client on this
   host, faster than any disk writes them: DRAM evicts to disk all along. Write-back
   throughput is the bytes written back over the seconds write-back had a write in
   flight (the node's ``writeback_bytes / writeback_busy_s``); objects dropped for a full
   queue are counted, not written.
2. **get from disk** (``--reps`` times): the node is stopped (SIGTERM: what DRAM holds is
   written to disk too, or relinked to its bytes there) and started again on the
   directory: DRAM empty, every object on disk. A client gets them all back, ``--batch``
   objects a call (each object read back by the node's I/O threads, checked against its
   record, then copied into the client's blocks and checked again), each call verified
   bitwise against what was put; GB/s of the calls' wall time. Recovery (objects,
   seconds) comes from the first restart's stats.
3. **hit ratio with both tiers** (``--part hits``): the conversation trace replayed as
   ``benchmarks/store_hit_ratio.py`` replays it (the same ``replay``: lookup, get the hit
   prefix, put the rest; 16-byte objects) through ``--nodes`` nodes of ``--dram-blocks``
   DRAM in all, first alone, then each with a disk tier of its share of ``--disk-blocks``;
   compared with an ideal LRU of the DRAM's capacity and of both tiers' together.

    PYTHONPATH=$PWD python benchmarks/store_disk.py --json benchmarks/results/store_disk.json
    PYTHONPATH=$PWD python benchmarks/store_disk.py --part hits --json benchmarks/results/store_disk_hits.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SECRET = "store-benchmark-secret-0123456789"
MiB = 1 << 20


def dd(args: list) -> float:
    """Bytes per second ``dd`` reports for ``args``."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(m.group(1)) / float(m.group(2))


def read_yardstick(directory: str, nbytes: int | None) -> float:
    """GB/s of ``dd iflag=direct`` reading ``directory/read-yardstick`` (written first, with
    ``oflag=direct``, when ``nbytes`` is given)."""
    path = os.path.join(directory, "read-yardstick")
    if nbytes is not None:
        dd(["if=/dev/urandom", f"of={path}", "bs=4M", f"count={max(1, nbytes // (4 * MiB))}", "oflag=direct"])
    return dd([f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"]) / 1e9


def yardstick(directory: str, nbytes: int) -> dict:
    path = os.path.join(directory, "yardstick")
    count = max(1, nbytes // (4 * MiB))
    write = dd(["if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "oflag=direct"])
    read = dd([f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"])
    os.unlink(path)
    return {"write_gbps": write / 1e9, "read_gbps": read / 1e9}


def start_node(dram: str, directory: str, disk_bytes: int, port: int = 0, extra=(), slot: str = "2M"):
    env = {**os.environ, "KVXFER_SECRET": SECRET}
    p = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "store", "--listen", f"127.0.0.1:{port}",
                          "--capacity", dram, "--slot-size", slot, "--disk", directory, "--disk-capacity",
                          str(disk_bytes), "--log-level", "warning", *extra],
                         env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = p.stdout.readline()
    if not line.startswith("kvxfer store listening on "):
        raise SystemExit(f"store node failed to start: {line!r}")
    return p, line.rsplit(" ", 1)[1].strip()


def stop_node(p) -> None:
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=300)


def tier_hits(args) -> dict:
    """Part 3: hit ratios on the conversation trace, DRAM alone and with a disk tier."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from store_hit_ratio import TRACE, load_trace, lru_replay, replay, start_nodes, stop_nodes

    trace = load_trace(args.trace or TRACE, args.requests)
    per_dram, per_disk = args.dram_blocks // args.nodes, args.disk_blocks // args.nodes
    wm = ("--high-watermark", "0.98")
    out = {"requests": len(trace), "nodes": args.nodes, "dram_blocks": args.dram_blocks,
           "disk_blocks": args.disk_blocks, "writeback_queue": args.writeback_queue}
    procs = start_nodes(args.nodes, str(per_dram * 64), "64", wm)
    try:
        t0 = time.perf_counter()
        hits, total, _ = replay([a for _, a in procs], trace)
        out["dram_only"] = {"hit_ratio": hits / total, "replay_s": time.perf_counter() - t0}
    finally:
        stop_nodes(procs)
    root = tempfile.mkdtemp(prefix="kvxfer-disk-hits-", dir=args.dir or os.getcwd())
    procs = []
    try:
        for i in range(args.nodes):
            procs.append(start_node(str(per_dram * 64), os.path.join(root, f"tier{i}"), per_disk * 64, slot="64",
                                    extra=(*wm, "--writeback-queue", args.writeback_queue)))
        t0 = time.perf_counter()
        hits, total, stats = replay([a for _, a in procs], trace)
        keep = ("dram_hits", "disk_hits", "dram_evictions", "disk_evictions", "writeback_objects", "writeback_drops",
                "disk_promotions", "disk_promote_failures", "disk_relinks", "disk_bad_objects", "disk_full_drops")
        out["tiers"] = {"hit_ratio": hits / total, "replay_s": time.perf_counter() - t0,
                        **{k: stats.get(k) for k in keep}}
    finally:
        for p, _ in procs:
            stop_node(p)
        subprocess.run(["rm", "-rf", root], check=False)
    g_hits, g_total = lru_replay(trace, args.dram_blocks + args.disk_blocks, 1)
    c_hits, _ = lru_replay(trace, args.dram_blocks, 1)
    out["blocks"] = g_total
    out["ideal_lru_c_plus_d"] = g_hits / g_total
    out["ideal_lru_c"] = c_hits / g_total
    out["tiers_vs_ideal_c_plus_d"] = out["tiers"]["hit_ratio"] / out["ideal_lru_c_plus_d"]
    out["tiers_vs_dram_only"] = out["tiers"]["hit_ratio"] / out["dram_only"]["hit_ratio"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("speed", "hits"), default="speed",
                    help="speed: write-back and get from disk against dd; hits: hit ratio with both tiers")
    ap.add_argument("--trace", default=None, help="hits: the conversation trace (JSONL with hash_ids)")
    ap.add_argument("--requests", type=int, default=None, help="hits: replay only the first N requests")
    ap.add_argument("--nodes", type=int, default=4, help="hits: store nodes")
    ap.add_argument("--dram-blocks", type=int, default=20000, help="hits: DRAM capacity C in blocks, all nodes")
    ap.add_argument("--disk-blocks", type=int, default=60000, help="hits: disk capacity D in blocks, all nodes")
    ap.add_argument("--writeback-queue", default="8K", help="hits: each node's --writeback-queue")
    ap.add_argument("--dir", default=None, help="a directory on the file system to measure (default: a new "
                    "one under the current directory)")
    ap.add_argument("--bytes", type=int, default=2048, help="MiB put (and read back)")
    ap.add_argument("--dram", default="256M")
    ap.add_argument("--batch", type=int, default=64, help="objects a get (at most 64)")
    ap.add_argument("--disk-threads", type=int, default=8, help="the node's --disk-threads")
    ap.add_argument("--reps", type=int, default=5, help="gets from disk: repetitions, each against its own dd read")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.part == "hits":
        out = {"cpus": os.cpu_count(), "hits": tier_hits(args)}
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return

    import torch

    import kvxfer

    root = tempfile.mkdtemp(prefix="kvxfer-disk-bench-", dir=args.dir or os.getcwd())
    tier = os.path.join(root, "tier")
    total = args.bytes * MiB
    nl, bs, nh, hd = 32, 16, 8, 128
    obj = nl * 2 * bs * nh * hd * 2
    nobj = total // obj
    npool = 64
    pool = [torch.randint(-2**15, 2**15, (2, npool, bs, nh, hd), dtype=torch.int16).view(torch.bfloat16)
            for _ in range(nl)]
    layout = kvxfer.KVLayout.from_tensors(pool, "2 N B H D")
    back = kvxfer.KVLayout.from_tensors([torch.zeros_like(t) for t in pool], "2 N B H D")
    chains = [kvxfer.block_keys([r] * (bs * npool), bs, salt=b"disk-bench") for r in range(-(-nobj // npool))]
    keys = [k for c in chains for k in c][:nobj]
    out = {"cpus": os.cpu_count(), "object_bytes": obj, "objects": nobj,
           "bytes": nobj * obj, "dram": args.dram, "batch": args.batch, "disk_threads": args.disk_threads,
           "dir_fs": _fs(root)}
    before = yardstick(root, nobj * obj)
    try:
        disk_bytes = (nobj + 64) * obj
        proc, addr = start_node(args.dram, tier, disk_bytes, extra=("--disk-threads", str(args.disk_threads)))
        try:
            with kvxfer.KVStore(nodes=[addr], secret=SECRET, staging_bytes=npool * obj, timeout=60.0) as st:
                t0 = time.perf_counter()
                for i in range(0, nobj, npool):
                    part = keys[i:i + npool]
                    st.put(part, layout, range(len(part))).wait(timeout=300)
                put_s = time.perf_counter() - t0
                while st.stats()["writeback_queue"]:
                    time.sleep(0.05)
                node = st.stats()["per_node"][addr]
        finally:
            stop_node(proc)
        out["write_back"] = {"put_s": put_s, "written_bytes": node["writeback_bytes"],
                             "written_objects": node["writeback_objects"], "busy_s": node["writeback_busy_s"],
                             "drops": node["writeback_drops"], "direct": node["disk_direct"],
                             "gbps": node["writeback_bytes"] / node["writeback_busy_s"] / 1e9}
        after = yardstick(root, nobj * obj)
        out["write_yardstick"] = {"before_gbps": before["write_gbps"], "after_gbps": after["write_gbps"],
                                  "gbps": (before["write_gbps"] + after["write_gbps"]) / 2}
        out["write_back_vs_dd_write"] = out["write_back"]["gbps"] / out["write_yardstick"]["gbps"]
        reps = []
        for rep in range(args.reps):  # each: dd reads as many bytes, then the node restarts and gets them all
            dd_read = read_yardstick(root, nobj * obj) if rep == 0 else read_yardstick(root, None)
            proc, addr = start_node(args.dram, tier, disk_bytes, extra=("--disk-threads", str(args.disk_threads)))
            try:
                with kvxfer.KVStore(nodes=[addr], secret=SECRET, staging_bytes=npool * obj, timeout=60.0) as st:
                    node = st.stats()["per_node"][addr]
                    if rep == 0:
                        out["recovery"] = {"objects": node["disk_recovered"], "bytes": node["disk_recovered_bytes"],
                                           "seconds": node["disk_recovery_s"]}
                    present = [i for i in range(nobj) if st.lookup([keys[i]]) == 1]
                    secs, moved = [], 0
                    for c in range(0, len(present), args.batch):
                        idx = present[c:c + args.batch]
                        t = time.perf_counter()
                        h = st.get([keys[i] for i in idx], back, range(len(idx)))
                        h.wait(timeout=300)
                        secs.append(time.perf_counter() - t)
                        moved += len(idx) * obj
                        if h.result.from_disk != len(idx):
                            raise SystemExit(f"a get read {h.result.from_disk} of {len(idx)} objects from disk")
                        src = [i % npool for i in idx]
                        for t_src, t_dst in zip(pool, back.tensors):
                            if not torch.equal(t_src[:, src].view(torch.int16), t_dst[:, :len(idx)].view(torch.int16)):
                                raise SystemExit("a get returned bytes that differ from the put")
                        for t_dst in back.tensors:
                            t_dst.zero_()
                    node = st.stats()["per_node"][addr]
            finally:
                stop_node(proc)  # what was read back is relinked to its bytes on disk: nothing written
            gbps = moved / sum(secs) / 1e9
            reps.append({"objects": len(present), "bytes": moved, "seconds": sum(secs), "gbps": gbps,
                         "dd_read_gbps": dd_read, "ratio": gbps / dd_read, "disk_hits": node["disk_hits"],
                         "bad": node["disk_bad_objects"]})
        out["get_from_disk"] = reps
        out["get_from_disk_vs_dd_read"] = statistics.median(r["ratio"] for r in reps)
    finally:
        subprocess.run(["rm", "-rf", root], check=False)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _fs(path: str) -> str:
    try:
        return subprocess.run(["df", "--output=fstype", path], capture_output=True, text=True).stdout.split()[-1]
    except (OSError, IndexError):
        return "unknown"


if __name__ == "__main__":
    main()
