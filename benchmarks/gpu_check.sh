#!/usr/bin/env bash
# GPU check, one command on a fresh GPU machine (it needs no network):
#   0. wheels carried in .whl/ (libucx-cu12, nixl-cu12: benchmarks/gpu/wheels.sh fetches them here) go to /tmp/site,
#   1. builds kvxfer._C with that machine's python3/torch,
#   2. the GPU tests (Triton kernels vs the reference on CUDA pools, the pool-to-pool copy, regions vs driver
#      allocations, the sm_90 compile, the stream-ordering tests, two-process CUDA IPC peers),
#   3. Triton pack/unpack vs a same-run device-to-device copy (Llama-3-8B and SmolLM2, 256/1024 blocks),
#   4. host microseconds per pack call (cached launch tables),
#   5. two-process GPU->GPU agent transfers of a 2,048-token Llama-3-8B request, vLLM per-layer and
#      cross-layer pools: the one-launch peer copy (cuda_peer), UCX zero-copy and pipelined pack, one
#      contiguous UCX put of the same bytes and NIXL where it imports; bitwise, rate vs a D2D copy;
#      on a machine with two GPUs also D on the second GPU, rate vs cudaMemcpyPeer,
#   6. PASS/FAIL per target. $OUT gets three files: summary.txt, summary.json (every figure and step),
#      logs.txt (every step's output). Each step has its own time limit, all of them 470 s together.
# Usage: benchmarks/gpu_check.sh [--cpu]
#   --cpu: the same steps on host pools (Triton interpreter, tiny shapes, vm transport): a plumbing check.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=cuda
[ "${1:-}" = "--cpu" ] && MODE=cpu
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUTDIR="${OUT:-/tmp/kvxfer-gpu-check}"
WORK="$(mktemp -d /tmp/kvxfer-gpu-work.XXXXXX)"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "$MODE" = cuda ]; then unset TRITON_INTERPRET; else export TRITON_INTERPRET=1; fi
STEPS="$WORK/steps.tsv"
: > "$STEPS"
DEADLINE=$((SECONDS + 470))
step() {  # step NAME SECONDS CMD...: run with a time limit (within DEADLINE), log to $WORK/NAME.log, record rc
    local name=$1 limit=$2; shift 2
    local left=$((DEADLINE - SECONDS))
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name (limit ${limit} s)"
    if [ "$limit" -lt 5 ]; then
        echo "skipped: out of time" > "$WORK/$name.log"
        printf '%s\t%s\t%s\n' "$name" 124 0 >> "$STEPS"
        return 124
    fi
    local t0=$SECONDS
    timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    tail -15 "$WORK/$name.log"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEPS"
    return $rc
}

if [ -d .whl ] && ! "$PY" -c "import libucx" 2>/dev/null; then
    echo "== installing carried wheels"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step environment 120 "$PY" - "$MODE" <<'PY'
import sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    sys.exit(f"triton missing: {e}")
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
import libucx; print("libucx", libucx.__file__)
PY
[ "$MODE" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv \
    > "$WORK/nvidia-smi.log" 2>&1

step build 300 "$PY" setup.py -q build_ext --inplace

TESTS=(tests/test_pack_triton.py tests/test_copy_blocks.py tests/test_pack_regions.py tests/test_pack_roundtrip.py
       tests/test_device_ordering.py tests/test_cuda_peer_gpu.py)
[ "$MODE" = cpu ] && TESTS=(tests/test_pack_triton.py tests/test_copy_blocks.py tests/test_pack_regions.py)
step tests 200 "$PY" -m pytest -q -ra -p no:cacheprovider "${TESTS[@]}"

if [ "$MODE" = cuda ]; then
    step pack_bench 150 "$PY" -m kvxfer.cli bench pack --device cuda --models Llama-3-8B,SmolLM2-135M \
        --blocks 256,1024 --no-torch --json "$WORK/pack.json"
    step overhead 60 "$PY" benchmarks/gpu/overhead.py --device cuda --json "$WORK/overhead.json"
    step transfer 120 "$PY" benchmarks/gpu/transfer.py --device cuda --backend ucx --json "$WORK/transfer.json"
    step transfer_cross 90 "$PY" benchmarks/gpu/transfer.py --device cuda --backend ucx --layout cross_layer \
        --phases cuda_peer,zero_copy,pack,nixl --json "$WORK/transfer_cross.json"
    if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        step transfer_2gpu 90 "$PY" benchmarks/gpu/transfer.py --device cuda:0 --d-device cuda:1 --backend ucx \
            --phases cuda_peer,pack,contig --json "$WORK/transfer_2gpu.json"
    fi
else
    step pack_bench 150 "$PY" -m kvxfer.cli bench pack --device cpu --models SmolLM2-135M --blocks 16 \
        --iters 2 --no-torch --json "$WORK/pack.json"
    step overhead 150 "$PY" benchmarks/gpu/overhead.py --device cpu --blocks 2 --json "$WORK/overhead.json"
    step transfer 150 "$PY" benchmarks/gpu/transfer.py --device cpu --backend auto --model SmolLM2-135M \
        --tokens 128 --pool-blocks 32 --reps 2 --staging-mib 4 --json "$WORK/transfer.json"
    step transfer_cross 150 "$PY" benchmarks/gpu/transfer.py --device cpu --backend auto --model SmolLM2-135M \
        --tokens 128 --pool-blocks 32 --reps 2 --staging-mib 4 --layout cross_layer --phases zero_copy,pack \
        --json "$WORK/transfer_cross.json"
fi

for f in "$WORK"/*.log; do echo "===== $(basename "$f")"; cat "$f"; done > "$OUTDIR/logs.txt"
"$PY" benchmarks/gpu/summary.py "$WORK" "$MODE" "$OUTDIR" | tee "$OUTDIR/summary.txt"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
