# Two entry points for users: `make demo` and `make test`. Both create .venv if missing and install.
# TORCH picks the torch release (default 2.14.1); another one gets a venv of its own:
#   make test TORCH=2.13.0        # .venv-torch2.13.0 (2.13.0's CPU wheel is local on these machines)
PY ?= python3
DEFAULT_TORCH := 2.14.1
TORCH ?= $(DEFAULT_TORCH)
VENV ?= $(if $(filter $(DEFAULT_TORCH),$(TORCH)),.venv,.venv-torch$(TORCH))
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow install bench titan titan-integration titan-bench conformance clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==$(TORCH)
	$(VPY) -m pip install -q -e '.[dev,titan]'
	$(VPY) -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$(TORCH)' else f'installed torch {v}, not $(TORCH)')"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

# Two pytest workers (pytest-xdist), each test module on one worker (its module fixtures built
# once): on 2 cores one worker's gloo ranks fill the other's waits. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
TESTS ?= tests
test: $(STAMP)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not slow" $(TESTS)

# The long training comparisons `make test` leaves out (marker `slow`).
test-slow: $(STAMP)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m slow tests

# torchtitan's own trainer with FSDP2 and with ours, every configuration (docs/torchtitan.md);
# `make test` runs its FSDP case only.
titan: $(STAMP)
	$(VPY) tests/train/titan/compare.py

# ragged_placement.integrations.torchtitan under torchtitan's own trainer (`torchrun -m
# torchtitan.train`): the long comparisons (AMSP and the partitioner against FSDP2's HSDP, Muon
# and block FP8 against one process); `make test` runs the short one.
titan-integration: $(STAMP)
	$(VPY) -m pytest -q -m slow tests/train/test_titan_integration.py

# torchtitan's tokens/s and memory, ours against FSDP2 (FSDP, HSDP, PP, AMSP), then FSDP2 HSDP
# against the partitioner's choice on two emulated nodes (root; docs/torchtitan.md).
titan-bench: $(STAMP)
	$(VPY) benchmarks/titan.py
	$(VPY) benchmarks/titan.py --two-nodes

bench: $(STAMP)
	$(VPY) -m pip install -q -e '.[dev,bench]'
	for b in benchmarks/[!_]*.py; do $(VPY) $$b || exit 1; done

# torch's own FSDP2 tests (test/distributed/_composable/fsdp of a pytorch checkout at the installed
# version's tag) with torch's fully_shard, then with ours: a table per file (docs/conformance.md).
TORCH_TESTS ?=
CONFORMANCE_ARGS ?=
conformance: $(STAMP)
	$(VPY) -m pip install -q -e '.[dev,conformance]'
	$(VPY) scripts/torch_fsdp2_conformance.py --tests "$(TORCH_TESTS)" $(CONFORMANCE_ARGS)

clean:
	rm -rf .venv .venv-torch* build *.egg-info
