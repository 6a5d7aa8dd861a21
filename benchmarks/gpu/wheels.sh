#!/usr/bin/env bash
# Fetch, here, the wheels gpu_check.sh (benchmarks/gpu_check.sh) needs on a GPU machine that its image lacks (it has no network):
# libucx-cu12 (UCX for kvxfer._C; its CUDA transports need only the driver's libcuda/libnvidia-ml) and
# nixl-cu12 (NIXL, the comparison on the same request; skipped there if it does not import).
# They land in .whl/ (ignored by git); the device call carries it: carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("libucx-cu12"))' 2>/dev/null || echo 1.22.0)"
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "libucx-cu12==$VERSION" \
    "nixl-cu12==1.5.1"
ls -la .whl
