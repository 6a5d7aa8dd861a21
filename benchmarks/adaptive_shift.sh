#!/usr/bin/env bash
# Adaptive P/D rebalancing vs the two static 3-worker splits, on a load whose mix
# shifts mid-run from prompt-heavy to decode-heavy (the target: adaptive >= the
# better static configuration). Same cores, same requests, same SLO for each run;
# drives benchmarks/serving_compare.sh.
#
#   SLO=4000,300 OUT=/tmp/adaptive benchmarks/adaptive_shift.sh
#
# Knobs (environment): RATE (req/s, default 0.4), PHASES (kvxfer loadgen --phases,
# default 20 prompts of 400 tokens with 4 output tokens, then 20 of 24 tokens with
# 64), CPUS (one CPU group shared by the 3 workers, default 0-1), ADAPTIVE (the
# --adaptive-* thresholds). Without SLO, the first server is asked for one
# (kvxfer loadgen --slo auto --calibrate-only on the run's median request).
# Results: $OUT/{a-static-2p1d,b-static-1p2d,c-adaptive-from-1p2d}.json and a ratio
# table against the first (kvxfer loadgen --results).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
RATE=${RATE:-0.4}
PHASES=${PHASES:-20:400:4,20:24:64}
CPUS=${CPUS:-0-1}
ADAPTIVE=${ADAPTIVE:---adaptive-interval 0.5 --adaptive-dwell 5 --adaptive-sustain 2 --adaptive-prefill-queue 1,3 --adaptive-decode-active 2,5}
export OUT=${OUT:-/tmp/kvxfer-adaptive}
export PORT=${PORT:-8123}
export LOAD="--poisson $RATE --phases $PHASES --spread 0.3 --seed 1"
export COMMON=${COMMON:---num-blocks 1024 --max-num-seqs 16 --max-num-batched-tokens 512 --threads 1 --cpus $CPUS}
export CONFIGS="a-static-2p1d|--prefill 2 --decode 1
b-static-1p2d|--prefill 1 --decode 2
c-adaptive-from-1p2d|--prefill 1 --decode 2 --adaptive $ADAPTIVE"
export PY
mkdir -p "$OUT"
if [ -z "${SLO:-}" ]; then
  $PY -m kvxfer.cli serve --port "$PORT" $COMMON --prefill 1 --decode 2 --log-level warning &
  server=$!
  trap 'kill -TERM $server 2>/dev/null || true' EXIT
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  SLO=$($PY -m kvxfer.cli loadgen --url "http://127.0.0.1:$PORT" $LOAD --slo auto --calibrate-only \
        | sed -n 's/.*reuse with --slo \([0-9.,]*\).*/\1/p')
  kill -TERM "$server"; wait "$server" || true; trap - EXIT
  [ -n "$SLO" ] || { echo "calibration failed"; exit 1; }
fi
export SLO
echo "SLO (TTFT_MS,TPOT_MS): $SLO; load: $LOAD"
benchmarks/serving_compare.sh
