#!/usr/bin/env bash
# Regenerates the benchmark result files in this folder from the current code, the
# exact commands behind the tables of docs/benchmarks.md; then prints those tables
# (python benchmarks/make_tables.py). Run from the repository root with the
# kvxfer environment active and nixl-cu12 installed (make bench-compare installs it).
# Not rerun here: serving_compare.json (benchmarks/serving_compare.sh) and adaptive_shift.json
# (benchmarks/adaptive_shift.sh) take 20-60 minutes each and need the Mooncake trace; their
# commands are in docs/benchmarks.md, "Serving" (the script writes $OUT/<label>.json, the
# committed file gathers those runs under the script name (and the phases) and <label>).
set -euo pipefail
R=benchmarks/results
export UCX_WARN_UNUSED_ENV_VARS=n
kvxfer bench e2e --model llama3-8b --tokens 2048 --iters 10 --rtt-iters 0 --compare nixl --json $R/e2e_llama3-8b.json
kvxfer bench e2e --model smollm2-135m --rtt-iters 300 --json $R/e2e_smollm2-135m.json
kvxfer bench transfer --backend vm --compare nixl --batch-size 2048 --start-block-size 4K --max-block-size 8K \
    --iters 20 --warmup 3 --rounds 2 --no-progress --json $R/transfer_vm_small.json
kvxfer bench transfer --backend vm --compare nixl --batch-size 256 --start-block-size 32K --max-block-size 256K \
    --iters 20 --warmup 3 --rounds 2 --no-progress --json $R/transfer_vm_large.json --plot $R/transfer_vm_large.png
UCX_TLS=tcp kvxfer bench transfer --backend ucx --batch-size 2048 --start-block-size 4K --max-block-size 64K \
    --iters 8 --warmup 2 --no-progress --json $R/transfer_tcp.json --plot $R/transfer_tcp.png
UCX_TLS=cma,tcp,self kvxfer bench transfer --vs-perftest --iters 10 --warmup 2 --no-progress \
    --json $R/transfer_vs_perftest.json
kvxfer bench pack --iters 9 --json $R/pack_cpu.json
# Two network namespaces, iperf3 + kvxfer + NIXL over TCP interleaved (needs root and iperf3).
if [ "$(id -u)" = 0 ] && command -v iperf3 >/dev/null; then
    PY=python REPS=5 benchmarks/tcp_netns.sh /tmp/kvxfer-tcp-sweep
    python benchmarks/tcp_summary.py /tmp/kvxfer-tcp-sweep --json $R/tcp_netns.json
    # striping: 4 lanes vs iperf3 -P 4 and NIXL's one worker, then NIXL's thread pool (large runs)
    PY=python REPS=3 LANES=4 benchmarks/tcp_netns.sh /tmp/kvxfer-tcp-lanes4
    python benchmarks/tcp_summary.py /tmp/kvxfer-tcp-lanes4 --json $R/tcp_netns_lanes4.json
    PY=python REPS=3 LANES=4 SMALL= NIXL_THREADS=4 NIXL_SPLIT=1 benchmarks/tcp_netns.sh /tmp/kvxfer-tcp-lanes4-nixl4
    python benchmarks/tcp_summary.py /tmp/kvxfer-tcp-lanes4-nixl4 --json $R/tcp_netns_lanes4_nixl_threads4.json
fi
python benchmarks/make_tables.py
