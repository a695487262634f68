# Quick start: `make run` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NO_DEPS = $(shell $(PYTHON) -c "import configparser as c; p=c.ConfigParser(); p.read('setup.cfg'); print(' '.join(p['moe_praxis.no_deps']['packages'].split()))")
PYTEST_ARGS ?=
# the CPU suite in two pytest-xdist workers (CI's machine has 2 cores; 0 runs it serially)
PYTEST_WORKERS ?= 2

.PHONY: install run test test-gpu format lint kernels clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@$(PYTHON) -c "import sys; assert sys.version_info >= (3, 11), 'moe_praxis needs Python 3.11+, found ' + sys.version"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev,cuda]'
	$(PY) -m pip install -q --no-deps $(NO_DEPS)
	$(PY) -m moe_praxis.praxis.import_hook  # praxis importable before moe_praxis
	touch $(STAMP)

run: install
	$(PY) -m experiments.main $(ARGS)

test: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=25 $(PYTEST_ARGS)

test-gpu: install
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

kernels: install
	$(PY) -m moe_praxis.build_kernels

format: install
	$(VENV)/bin/yapf -i -r moe_praxis configs experiments benchmarks tests

lint: install
	$(VENV)/bin/yapf --diff -r moe_praxis configs experiments benchmarks tests

clean:
	rm -rf $(VENV) build *.egg-info
