#!/usr/bin/env bash
# GPU check for pack/unpack (issue 2), sized for one H200 in well under 8 minutes:
#   1. the GPU tests (Triton kernels vs the torch reference, bit-exact),
#   2. Triton pack/unpack GB/s vs a device-to-device copy of the same bytes
#      (kvxfer bench pack --device cuda), for every model shape at 128 and 1024 blocks,
#   3. a PASS/FAIL line per shape against the 0.85x target.
# Usage: benchmarks/gpu_check.sh            (run from anywhere; $OUT collects the JSON/logs if set)
# Needs: a CUDA build of torch and triton importable by $PYTHON (default: .venv/bin/python, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUTDIR="${OUT:-/tmp/kvxfer-gpu-check}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
status=0

echo "== environment"
timeout 60 "$PY" - <<'PY' || { echo "FAIL: torch with CUDA and triton are required"; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true

echo "== GPU tests (pytest -m gpu + compile + layout tests)"
if ! timeout 240 "$PY" -m pytest -q -ra -p no:cacheprovider \
        tests/test_pack_triton.py tests/test_pack_roundtrip.py tests/test_layout.py \
        2>&1 | tee "$OUTDIR/gpu_tests.log" | tail -25; then
    status=1
fi
grep -qE "[0-9]+ passed" "$OUTDIR/gpu_tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUTDIR/gpu_tests.log" \
    || { echo "FAIL: GPU tests"; status=1; }

echo "== Triton pack/unpack vs device-to-device copy"
if ! timeout 240 "$PY" -m kvxfer.cli bench pack --device cuda --blocks 128,1024 --max-gib 100 --no-torch \
        --json "$OUTDIR/pack_gpu.json" 2>&1 | tee "$OUTDIR/pack_gpu.log"; then
    echo "FAIL: benchmark did not finish"
    status=1
fi

echo "== targets (pack and unpack >= 0.85 x copy)"
timeout 30 "$PY" - "$OUTDIR/pack_gpu.json" <<'PY' || status=1
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
bad = 0
for r in rows:
    ok = r["pack_ratio"] >= 0.85 and r["unpack_ratio"] >= 0.85
    bad += not ok
    print(f"{'PASS' if ok else 'FAIL'} {r['model']:>13} x{r['blocks']:>5}: pack {r['pack_gbps']:7.1f} GB/s "
          f"({r['pack_ratio']:.2f}x), unpack {r['unpack_gbps']:7.1f} GB/s ({r['unpack_ratio']:.2f}x), "
          f"copy {r['copy_gbps']:7.1f} GB/s")
sys.exit(1 if bad or not rows else 0)
PY
echo "== done (status $status); logs and JSON in $OUTDIR"
exit $status
