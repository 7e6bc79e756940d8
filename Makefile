# Two entry points on a fresh machine:
#   make demo   runs the main job on embedded defaults (local models, no hub, no GPU needed)
#   make test   runs the test suite
# Both create (or reuse) .venv and install what they need.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Artifacts of the demo live under one home folder; override with BLOCKPILOT_HOME=...
BLOCKPILOT_HOME ?= $(HOME)/.cache/blockpilot
export BLOCKPILOT_HOME
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# The venv is installed with --no-compile, so Python caches the bytecode of what a run imports, once. An
# environment that sets PYTHONDONTWRITEBYTECODE (some sandboxes and CI images do) would make every process, each
# Ray worker included, compile torch, ray and mlflow again: 11.5 s to import them against 5.4 s with the cache.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv demo test test-fast bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch first, pinned, so that pip takes the local CPU wheel instead of the newest CUDA build.
# --no-compile: pip would byte-compile every file of torch, ray and mlflow (about 70 s of a 110 s install on
# 2 cores); Python compiles the modules a run imports, when it first imports them.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile "torch==2.13.0"
	$(BIN)/python -m pip install --quiet --no-compile -e ".[ray,mlflow,dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(BIN)/python -m blockpilot demo --home "$(BLOCKPILOT_HOME)"

# Two pytest workers (pytest-xdist), each with its own embedded Ray when a test asks for one; the tiny zoo and its
# labels are built once and shared. --dist loadscope keeps each module on one worker, so a module fixture (the
# Serve apps, the notebooks' demo home, a module's Ray) is set up once, not on both: 347 s for the whole suite
# against 432-442 s with tests dealt one by one (warm, zoo kept). (loadgroup would do it per mark, but its marks
# are ignored under pytest 9.2: pytest-xdist issue 1386.) Modules are dealt in the order tests/conftest.py gives
# them, longest first, not re-sorted by their test counts. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder)

test: venv
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# Local iteration: skip the slow end-to-end tests (CI runs everything).
test-fast: venv
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow" $(PYTEST_ARGS)

bench: venv
	$(BIN)/python benchmarks/bench_decoding.py

clean:
	rm -rf $(VENV) .pytest_cache
