#!/usr/bin/env bash
# kvxfer (and NIXL) over UCX TCP between two network namespaces joined by a veth
# pair, against iperf3 (native TCP) over the same link, interleaved:
#   iperf3, kvxfer+NIXL small runs, kvxfer+NIXL large runs, iperf3, ... (REPS times)
# Each repetition's ratio uses the mean of the iperf3 runs just before and just
# after it; benchmarks/tcp_summary.py prints per-repetition ratios and medians.
# Needs root, iproute2 and iperf3 (Debian: apt-get install -y iperf3).
#   benchmarks/tcp_netns.sh [OUT_DIR]
# Environment: PY (python), REPS (3), ITERS (20), NIXL (1: also NIXL over TCP when
# importable), SMALL ("4K 8K 2048": min max batch), LARGE ("64K 1M 64"),
# IPERF_S (4); anything else (UCX_*) passes through to both sides.
set -euo pipefail
OUT=${1:-/tmp/kvxfer-tcp-netns}
PY=${PY:-python3}
REPS=${REPS:-3}; ITERS=${ITERS:-20}; IPERF_S=${IPERF_S:-4}
SMALL=${SMALL:-4K 8K 2048}; LARGE=${LARGE:-64K 1M 64}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"; rm -f "$OUT"/*.json "$OUT"/*.log "$OUT"/load.txt
A=kvxtA$$; B=kvxtB$$; VA=vta$$; VB=vtb$$
IPA=10.88.$(( $$ % 200 )).1; IPB=10.88.$(( $$ % 200 )).2
cleanup() {
    ip netns pids "$B" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns pids "$A" 2>/dev/null | xargs -r kill 2>/dev/null || true
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

COMPARE=()
if [ "${NIXL:-1}" = 1 ] && "$PY" -c "from kvxfer.bench.nixl import available; raise SystemExit(available() is None)"; then
    COMPARE=(--compare nixl --rounds 2)
fi
echo "nixl: ${COMPARE[*]:-not importable or NIXL=0}" | tee "$OUT/setup.txt"
export KVXFER_BENCH_SECRET=${KVXFER_BENCH_SECRET:-netns-bench-secret} UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n
# kvxfer's own TCP segment size (kvxfer/transport/ucx.py UCX_DEFAULTS) for both sides,
# so NIXL's UCX runs with the same segments as kvxfer's rather than UCX's 8 KiB default
export UCX_TCP_TX_SEG_SIZE=${UCX_TCP_TX_SEG_SIZE:-512k} UCX_TCP_RX_SEG_SIZE=${UCX_TCP_RX_SEG_SIZE:-512k}
env | grep -E '^UCX_' | sort >> "$OUT/setup.txt"

load() { echo "$1 $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.txt"; }

wait_port() {  # $1 port: listening in B within 30 s
    for _ in $(seq 300); do
        ip netns exec "$B" ss -ltnH "sport = :$1" | grep -q . && return 0
        sleep 0.1
    done
    echo "nothing listens on $IPB:$1" >&2; return 1
}

# Native TCP limit over the veth: one stream, 128 KiB writes.
iperf() {
    ip netns exec "$B" iperf3 -s -1 -B "$IPB" -p 5201 >/dev/null 2>&1 &
    local spid=$!
    wait_port 5201
    ip netns exec "$A" iperf3 -c "$IPB" -p 5201 -t "$IPERF_S" -l 128K -J > "$OUT/iperf3-$1.json"
    wait "$spid" 2>/dev/null || true
}

# One kvxfer bench sweep (and NIXL, rounds alternating per row): $1 tag, $2 min, $3 max, $4 batch.
sweep() {
    ip netns exec "$B" "$PY" -m kvxfer.cli bench transfer --listen "$IPB:5555" "${COMPARE[@]}" \
        > "$OUT/listen-$1.log" 2>&1 &
    local lpid=$!
    wait_port 5555
    [ ${#COMPARE[@]} -eq 0 ] || wait_port 5556
    ip netns exec "$A" "$PY" -m kvxfer.cli bench transfer --connect "$IPB:5555" --backend ucx \
        --no-progress --start-block-size "$2" --max-block-size "$3" --batch-size "$4" \
        --iters "$ITERS" "${COMPARE[@]}" --json "$OUT/kvxfer-$1.json" > "$OUT/kvxfer-$1.log" 2>&1 \
        || { cat "$OUT/kvxfer-$1.log" "$OUT/listen-$1.log" >&2; return 1; }
    wait "$lpid" 2>/dev/null || true
}

for rep in $(seq "$REPS"); do
    load "rep$rep"
    iperf "$rep"
    # shellcheck disable=SC2086
    sweep "small-$rep" $SMALL
    # shellcheck disable=SC2086
    sweep "large-$rep" $LARGE
    echo "rep $rep of $REPS done"
done
iperf "$(( REPS + 1 ))"
load end
"$PY" "$HERE/tcp_summary.py" "$OUT" | tee "$OUT/summary.md"
