#!/usr/bin/env bash
# Serve each configuration in turn on the same two cores and replay the same load
# against it with `kvxfer loadgen`; results in $OUT/<label>.json.
#
#   OUT=/tmp/serving LOAD="--trace benchmarks/traces/mooncake_conversation_1000.jsonl \
#     --start 0 --max-requests 40 --length-scale 0.05 --time-scale 12" \
#     SLO=4000,200 benchmarks/serving_compare.sh
#
# Every configuration gets the same --max-num-batched-tokens/--max-num-seqs; a
# server that does not come up within 300 s is killed and the script stops.
set -euo pipefail
PY=${PY:-python}
OUT=${OUT:-/tmp/kvxfer-serving}
PORT=${PORT:-8123}
COMMON=${COMMON:---num-blocks 1024 --max-num-seqs 16 --max-num-batched-tokens 256}
mkdir -p "$OUT"
CONFIGS=${CONFIGS:-"colocated-mixed|--colocated 2 --cpus 0 1 --schedule mixed
colocated-separate|--colocated 2 --cpus 0 1 --schedule separate
disagg|--prefill 1 --decode 1 --cpus 0 1
disagg-conditional|--prefill 1 --decode 1 --cpus 0 1 --local-prefill-tokens ${LOCAL_TOKENS:-32} --local-prefill-queue ${LOCAL_QUEUE:-4}"}

while IFS='|' read -r label args; do
  [ -z "$label" ] && continue
  $PY -m kvxfer.cli serve --port "$PORT" $COMMON $args --log-level warning &
  server=$!
  trap 'kill -TERM $server 2>/dev/null || true' EXIT
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "$label: server not up"; exit 1; }
  echo "== $label ($args), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  $PY -m kvxfer.cli loadgen --url "http://127.0.0.1:$PORT" $LOAD --slo "$SLO" --label "$label" \
      --json "$OUT/$label.json" --no-progress || true
  curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/$label.metrics.txt" || true  # e.g. role changes
  kill -TERM "$server"
  wait "$server" || true
  trap - EXIT
done <<< "$CONFIGS"
$PY -m kvxfer.cli loadgen --results "$OUT"/*.json --slo "$SLO" --plot "$OUT/cdf.png"
