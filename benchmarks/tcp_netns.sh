#!/usr/bin/env bash
# kvxfer over UCX TCP between two network namespaces joined by a veth pair,
# against iperf3 (native TCP) over the same link, in the same run.
# Needs root, iproute2 and iperf3 (Debian: apt-get install -y iperf3).
#   benchmarks/tcp_netns.sh [OUT_DIR] [extra `kvxfer bench transfer` args...]
# Environment passed through to both kvxfer sides (e.g. UCX_TCP_TX_SEG_SIZE=256k).
set -euo pipefail
OUT=${1:-/tmp/kvxfer-tcp-netns}; shift || true
PY=${PY:-python3}
mkdir -p "$OUT"
A=kvxtA$$; B=kvxtB$$; VA=vta$$; VB=vtb$$
IPA=10.88.$(( $$ % 200 )).1; IPB=10.88.$(( $$ % 200 )).2
cleanup() {
    [ -n "${LPID:-}" ] && kill "$LPID" 2>/dev/null || true
    ip netns pids "$B" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$A"; ip netns add "$B"
ip link add "$VA" type veth peer name "$VB"
ip link set "$VA" netns "$A"; ip link set "$VB" netns "$B"
ip -n "$A" addr add "$IPA/24" dev "$VA"; ip -n "$B" addr add "$IPB/24" dev "$VB"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "$VA" up; ip -n "$B" link set "$VB" up
sleep 1  # veth up

echo "load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/load.txt"
# Native TCP limit over the veth: one stream, 128 KiB writes, 8 s; measured
# before and after the kvxfer sweep (the ratio uses their mean).
iperf() {
    ip netns exec "$B" iperf3 -s -1 -B "$IPB" >/dev/null 2>&1 &
    sleep 1
    ip netns exec "$A" iperf3 -c "$IPB" -t 8 -l 128K -J > "$OUT/iperf3-$1.json"
    wait $! 2>/dev/null || true
}
iperf before
export KVXFER_BENCH_SECRET=${KVXFER_BENCH_SECRET:-netns-bench-secret} UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n
ip netns exec "$B" "$PY" -m kvxfer.cli bench transfer --listen "$IPB:5555" > "$OUT/listen.log" 2>&1 &
LPID=$!
sleep 3
ip netns exec "$A" "$PY" -m kvxfer.cli bench transfer --connect "$IPB:5555" --backend ucx \
    --no-progress --json "$OUT/kvxfer.json" "$@" | tee "$OUT/kvxfer.txt"
wait "$LPID" 2>/dev/null || true
LPID=
iperf after
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
runs = [json.load(open(f"{out}/iperf3-{w}.json"))["end"]["sum_received"]["bits_per_second"] / 8e9
        for w in ("before", "after")]
bps = sum(runs) / 2
rows = json.load(open(f"{out}/kvxfer.json"))["rows"]
print(f"iperf3 over the veth: {runs[0]:.2f} GB/s before, {runs[1]:.2f} after, mean {bps:.2f}")
for r in rows:
    print(f"{r['block']:>8} x {r['batch']}: kvxfer {r['gbps']:.2f} GB/s ({r['transport']}) = {r['gbps'] / bps:.2f}x iperf3")
PYEOF
