"""The KV store's yardsticks, through real ``kvxfer store`` node processes, in one run.

1. ``hit``: replay the Mooncake conversation trace (512-token blocks named by
   ``hash_ids``) through ``--nodes`` store nodes of ``--capacity-blocks`` slots in all,
   with tiny objects (16 bytes each). Per request: ``lookup`` the chain, ``get`` the hit
   prefix (which refreshes it), ``put`` the rest. The ratio is leading-prefix hits over all
   prompt blocks. Compared, on the same replay rule, with an ideal global LRU of the same
   capacity and with 8 per-engine LRUs of ``capacity/8`` fed round-robin (what engines
   without a pool get).
2. ``throughput``: put and get of 2 MiB objects (one block of a 32-layer, 8-kv-head,
   head-dim-128, bf16 model, 16 tokens a block) between an NHD pool and one node on this
   host, GB/s over ``--batch`` objects a call, with and without checksums, against the
   memcpy limit of the same bytes measured in the same run on the same resources (the
   caches flushed before every timed copy, put and get, so all read memory; --warm: not):
   the vm copy pool's threads copy (each object copied, and with checksums hashed, in one
   pass on one of them, objects taken in turn; batches below the pool's split size: the
   calling thread alone), so the limit is a copy on that many threads, streaming stores
   allowed.
3. ``lookup``: ``lookup`` of a 64-key chain spread over the nodes, p50/p99 (one request to
   each node involved, all in flight at once).

    PYTHONPATH=$PWD python benchmarks/store_hit_ratio.py --json benchmarks/results/store.json
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
from collections import OrderedDict

SECRET = "store-benchmark-secret-0123456789"
TRACE = "benchmarks/traces/mooncake_conversation_trace.jsonl"


def start_nodes(n: int, capacity: str, slot: str, extra=()) -> list:
    env = {**os.environ, "KVXFER_SECRET": SECRET}
    procs = []
    for _ in range(n):
        p = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "store", "--listen", "127.0.0.1:0",
                              "--capacity", capacity, "--slot-size", slot, "--log-level", "warning", *extra],
                             env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = p.stdout.readline()
        if not line.startswith("kvxfer store listening on "):
            raise SystemExit(f"store node failed to start: {line!r}")
        procs.append((p, line.rsplit(" ", 1)[1].strip()))
    return procs


def stop_nodes(procs) -> None:
    for p, _ in procs:
        os.killpg(p.pid, signal.SIGTERM)
    for p, _ in procs:
        p.wait(timeout=30)


def load_trace(path: str, limit: int | None):
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["hash_ids"])
            if limit and len(out) >= limit:
                break
    return out


def lru_replay(trace, capacity: int, engines: int = 1) -> tuple[int, int]:
    """Leading-prefix hits over blocks, each request to engine ``i % engines``'s LRU of
    ``capacity // engines`` blocks (hits refreshed, misses inserted)."""
    caches = [OrderedDict() for _ in range(engines)]
    per = capacity // engines
    hits = total = 0
    for i, ids in enumerate(trace):
        c = caches[i % engines]
        n = 0
        while n < len(ids) and ids[n] in c:
            n += 1
        for h in ids[:n]:
            c.move_to_end(h)
        for h in ids[n:]:
            c[h] = True
            c.move_to_end(h)
            while len(c) > per:
                c.popitem(last=False)
        hits += n
        total += len(ids)
    return hits, total


def replay(addrs: list, trace) -> tuple[int, int, dict]:
    """Replay ``trace`` through the nodes at ``addrs`` as an engine with the pool would:
    ``lookup`` the chain, ``get`` the hit prefix (which refreshes it), ``put`` the rest.
    Returns ``(hits, blocks, the pool's stats())``; a get that misses part of its prefix
    (a node's read from disk outlasting its wait) counts what it loaded and puts the rest."""
    import torch

    import kvxfer

    layout = kvxfer.KVLayout.from_tensors([torch.zeros(2, 256, 1, 1, 4, dtype=torch.float16)], "2 N B H D")
    hits = total = 0
    with kvxfer.KVStore(nodes=addrs, secret=SECRET, timeout=30.0) as st:
        for ids in trace:
            keys = [b"h" + h.to_bytes(8, "little") for h in ids]
            n = st.lookup(keys)
            for s in range(0, len(keys), 256):  # the pool has 256 blocks; a chain may be longer
                part = keys[s:s + 256]
                ids_ = list(range(len(part)))
                k = min(max(n - s, 0), len(part))
                if k:
                    try:
                        st.get(part[:k], layout, ids_[:k]).wait(timeout=60)
                    except kvxfer.StoreMiss as exc:
                        n, k = s + exc.loaded, exc.loaded
                if k < len(part):
                    st.put(part[k:], layout, ids_[k:]).wait(timeout=60)
            hits += n
            total += len(keys)
        return hits, total, st.stats()


def hit_ratio(args) -> dict:
    trace = load_trace(args.trace, args.requests)
    slots = args.capacity_blocks // args.nodes
    procs = start_nodes(args.nodes, str(slots * 64), "64", ("--high-watermark", str(args.high_watermark)))
    try:
        t0 = time.perf_counter()
        hits, total, stats = replay([a for _, a in procs], trace)
        elapsed = time.perf_counter() - t0
    finally:
        stop_nodes(procs)
    g_hits, g_total = lru_replay(trace, args.capacity_blocks, 1)
    e_hits, _ = lru_replay(trace, args.capacity_blocks, 8)
    store, glob, eng = hits / total, g_hits / g_total, e_hits / g_total
    return {"requests": len(trace), "blocks": total, "nodes": args.nodes, "capacity_blocks": args.capacity_blocks,
            "high_watermark": args.high_watermark, "store_hit_ratio": store, "global_lru_hit_ratio": glob,
            "per_engine_lru_hit_ratio": eng, "vs_global_lru": store / glob, "vs_per_engine": store / eng,
            "evictions": stats["evictions"], "replay_s": elapsed}


def throughput(args) -> dict:
    import torch

    import kvxfer
    from kvxfer.bench.copy_limit import MemcpyLimit
    from kvxfer.bench.resources import transport_threads

    nl, bs, nh, hd = 32, 16, 8, 128
    nblk = args.batch
    pool = [torch.randint(-2**15, 2**15, (2, nblk, bs, nh, hd), dtype=torch.int16).view(torch.bfloat16)
            for _ in range(nl)]
    layout = kvxfer.KVLayout.from_tensors(pool, "2 N B H D")
    back = kvxfer.KVLayout.from_tensors([torch.zeros_like(t) for t in pool], "2 N B H D")  # gets land here
    obj = nl * 2 * bs * nh * hd * 2
    nbytes = nblk * obj
    # room for 16 calls: a client keeps spare slots for its next put (as many as its last
    # one wrote) only up to 1/16 of a node's slots
    procs = start_nodes(1, str(16 * nbytes), str(obj))
    threads = transport_threads("vm", nbytes)
    out = {"object_bytes": obj, "objects_per_call": nblk, "iters": args.iters, "limit_threads": threads}
    try:
        cold = not args.warm
        limit = MemcpyLimit(nbytes, threads=threads, streaming=True, cold=cold)
        flush = limit.flusher.flush if cold else (lambda: None)
        out["caches"] = "flushed before every timed copy, put and get" if cold else "as the run leaves them"
        stores = {tag: kvxfer.KVStore(nodes=[procs[0][1]], secret=SECRET, staging_bytes=nbytes, timeout=30.0,
                                      checksum=tag == "crc") for tag in ("crc", "nocrc")}
        samples = {k: [] for k in ("memcpy", "put_crc", "get_crc", "put_nocrc", "get_nocrc")}
        try:
            # interleaved, so that the limit and the paths see the same machine (it is shared)
            for it in range(args.iters + 2):
                mem = limit.sample()
                for tag, st in stores.items():
                    keys = kvxfer.block_keys([it] * (bs * nblk), bs, salt=b"tp-" + tag.encode())
                    flush()
                    t = time.perf_counter()
                    st.put(keys, layout, range(nblk)).wait(timeout=120)
                    t1 = time.perf_counter()
                    flush()
                    t1f = time.perf_counter()
                    st.get(keys, back, range(nblk)).wait(timeout=120)
                    t2 = time.perf_counter()
                    if not all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                               for a, b in zip(pool, back.tensors)):
                        raise SystemExit("a get returned bytes that differ from the put")
                    for x in back.tensors:
                        x.zero_()
                    if it >= 2:
                        samples[f"put_{tag}"].append(t1 - t)
                        samples[f"get_{tag}"].append(t2 - t1f)
                if it >= 2:
                    samples["memcpy"].append(mem)
        finally:
            for st in stores.values():
                st.close()
        for name, sec in samples.items():
            out[f"{name}_gbps"] = nbytes / statistics.median(sec) / 1e9
        for name in ("put_crc", "get_crc", "put_nocrc", "get_nocrc"):
            out[f"{name}_vs_memcpy"] = out[f"{name}_gbps"] / out["memcpy_gbps"]
    finally:
        stop_nodes(procs)
    return out


def lookup_latency(args) -> dict:
    import torch

    import kvxfer

    procs = start_nodes(args.nodes, "4M", "64")
    try:
        layout = kvxfer.KVLayout.from_tensors([torch.zeros(2, 64, 1, 1, 4, dtype=torch.float16)], "2 N B H D")
        out = {"nodes": args.nodes, "keys": 64}
        with kvxfer.KVStore(nodes=[a for _, a in procs], secret=SECRET, timeout=30.0) as st:
            keys = kvxfer.block_keys(range(64 * 16), 16, salt=b"lookup")
            st.put(keys, layout, range(64)).wait(timeout=60)
            assert st.lookup(keys) == 64
            for _ in range(200):
                st.lookup(keys)
            lat = []
            for _ in range(args.lookups):
                t = time.perf_counter()
                st.lookup(keys)
                lat.append(time.perf_counter() - t)
        lat.sort()
        out.update(p50_us=lat[len(lat) // 2] * 1e6, p99_us=lat[int(len(lat) * 0.99)] * 1e6, samples=len(lat))
    finally:
        stop_nodes(procs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "hit", "throughput", "lookup"), default="all")
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--capacity-blocks", type=int, default=20000)
    p.add_argument("--high-watermark", type=float, default=0.98)
    p.add_argument("--batch", type=int, default=16, help="2 MiB objects per put/get call")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--warm", action="store_true", help="throughput: do not flush the caches before each timed copy, put and get (a back-to-back copy reads a source the last one left in cache)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = {"loadavg": os.getloadavg(), "cpus": os.cpu_count()}
    if args.part in ("all", "hit"):
        result["hit"] = hit_ratio(args)
        print("hit:", json.dumps(result["hit"]), flush=True)
    if args.part in ("all", "throughput"):
        result["throughput"] = throughput(args)
        print("throughput:", json.dumps(result["throughput"]), flush=True)
    if args.part in ("all", "lookup"):
        result["lookup"] = lookup_latency(args)
        print("lookup:", json.dumps(result["lookup"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
