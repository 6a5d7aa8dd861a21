#!/usr/bin/env bash
# kvxfer (and NIXL) over UCX TCP between two network namespaces joined by a veth
# pair, against iperf3 (native TCP) over the same link, interleaved:
#   iperf3, kvxfer+NIXL small runs, kvxfer+NIXL large runs, iperf3, ... (REPS times)
# Each repetition's ratio uses the mean of the iperf3 runs just before and just
# after it; benchmarks/tcp_summary.py prints per-repetition ratios and medians.
# Needs root, iproute2 and iperf3 (Debian: apt-get install -y iperf3).
#   benchmarks/tcp_netns.sh [OUT_DIR]
# Environment: PY (python), REPS (3), ITERS (20), NIXL (1: also NIXL over TCP when
# importable), SMALL ("4K 8K 2048": min max batch; "" skips), LARGE ("64K 1M 64"),
# IPERF_S (4), LANES (kvxfer's TCP connections per peer, KVXFER_TCP_LANES; default:
# AgentConfig's), NIXL_THREADS / NIXL_SPLIT (NIXL UCX num_threads / split_batch_size:
# "4" / "1" stripes each NIXL transfer over 4 workers' connections; default: NIXL's
# single worker); anything else (UCX_*) passes through to both sides.
# With LANES > 1 every iperf3 point is run twice: -P 1 and -P LANES (the native limit
# of as many TCP streams as kvxfer uses); ss-lanes.txt records the TCP connections
# between the namespaces while kvxfer transfers.
set -euo pipefail
OUT=${1:-/tmp/kvxfer-tcp-netns}
PY=${PY:-python3}
REPS=${REPS:-3}; ITERS=${ITERS:-20}; IPERF_S=${IPERF_S:-4}
SMALL=${SMALL-4K 8K 2048}; LARGE=${LARGE:-64K 1M 64}
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

LANES=${LANES:-$("$PY" -c "from kvxfer import AgentConfig; print(AgentConfig().tcp_lanes)")}
export KVXFER_TCP_LANES=$LANES
echo "kvxfer tcp_lanes: $LANES" > "$OUT/setup.txt"
COMPARE=()
if [ "${NIXL:-1}" = 1 ] && "$PY" -c "from kvxfer.bench.nixl import available; raise SystemExit(available() is None)"; then
    COMPARE=(--compare nixl --rounds 2)
    [ -z "${NIXL_THREADS:-}" ] || COMPARE+=(--nixl-threads "$NIXL_THREADS")
    [ -z "${NIXL_SPLIT:-}" ] || COMPARE+=(--nixl-split-batch "$NIXL_SPLIT")
fi
echo "nixl: ${COMPARE[*]:-not importable or NIXL=0}" | tee -a "$OUT/setup.txt"
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

# Native TCP limit over the veth, 128 KiB writes: one stream (iperf3-K.json) and, with
# LANES > 1, LANES streams (iperf3pN-K.json).
iperf_run() {  # $1 file, $2 streams
    ip netns exec "$B" iperf3 -s -1 -B "$IPB" -p 5201 >/dev/null 2>&1 &
    local spid=$!
    wait_port 5201
    ip netns exec "$A" iperf3 -c "$IPB" -p 5201 -t "$IPERF_S" -l 128K -P "$2" -J > "$OUT/$1"
    wait "$spid" 2>/dev/null || true
}
iperf() {
    iperf_run "iperf3-$1.json" 1
    [ "$LANES" -le 1 ] || iperf_run "iperf3p$LANES-$1.json" "$LANES"
}

# The TCP connections kvxfer opens: one write sweep of 1 MiB x 64, ss sampled meanwhile.
lanes_check() {
    ip netns exec "$B" "$PY" -m kvxfer.cli bench transfer --listen "$IPB:5555" > "$OUT/listen-ss.log" 2>&1 &
    local lpid=$!
    wait_port 5555
    ip netns exec "$A" "$PY" -m kvxfer.cli bench transfer --connect "$IPB:5555" --backend ucx --no-progress \
        --start-block-size 1M --max-block-size 1M --batch-size 64 --iters 200 > "$OUT/kvxfer-ss.log" 2>&1 &
    local cpid=$!
    sleep 4
    { echo "ESTAB TCP connections in $A while kvxfer transfers (port 5555: the bench's control channel):"
      ip netns exec "$A" ss -tnH state established; } > "$OUT/ss-lanes.txt"
    wait "$cpid" || true; wait "$lpid" 2>/dev/null || true
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

lanes_check
for rep in $(seq "$REPS"); do
    load "rep$rep"
    iperf "$rep"
    # shellcheck disable=SC2086
    [ -z "$SMALL" ] || sweep "small-$rep" $SMALL
    # shellcheck disable=SC2086
    sweep "large-$rep" $LARGE
    echo "rep $rep of $REPS done"
done
iperf "$(( REPS + 1 ))"
load end
"$PY" "$HERE/tcp_summary.py" "$OUT" | tee "$OUT/summary.md"
