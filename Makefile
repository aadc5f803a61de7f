# Quick start: `make demo` (set up .venv, build, run the main job) and
# `make test` (set up, build, run every test). Both work on a fresh machine.
VENV    ?= .venv
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test build venv bench clean info

$(PY):
	python3 -m venv $(VENV)

# torch is installed only when none is present, so a venv with another torch
# (the GPU machine's) is used as it is. Never let pip pick a CUDA build here.
$(VENV)/.deps: requirements-dev.txt | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.deps

# The editable install (once) makes `membudget` and `python -m membudget` work
# in the venv; every build after it is CMake's incremental one.
$(VENV)/.installed: setup.py | $(VENV)/.deps
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.installed
	$(PY) setup.py -q build_ext --inplace
	$(PY) -m membudget.info

demo: build
	$(PY) -m membudget demo

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: build
	$(PY) bench/bench_swap.py

info: build
	$(PY) -m membudget.info

clean:
	rm -rf build python/membudget/_C*.so *.egg-info python/*.egg-info $(VENV)/.installed
