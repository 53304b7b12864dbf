# Two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.distopt-installed
# Without a CUDA driver, pin the CPU torch build (see constraints/cpu.txt).
CONSTRAINT := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "-c constraints/cpu.txt")
PYTEST_ARGS ?=

.PHONY: install demo test test-gpu test-torchx-nightly lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(CONSTRAINT) -e '.[dev,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/distopt demo

# tests/remote runs in its own processes: PyTorch keeps a process's RRef context bound to
# the first RPC group that used RRefs, so it cannot follow tests that formed other groups.
test: $(STAMP)
	$(PY) -m pytest -n 2 --ignore=tests/remote $(PYTEST_ARGS)
	$(PY) -m pytest -n 2 tests/remote $(PYTEST_ARGS)

# Tests that need a CUDA GPU (marked `cuda`; skipped elsewhere).
test-gpu: $(STAMP)
	$(PY) -m pytest -m cuda $(PYTEST_ARGS)

# The Ray scheduler under torchx-nightly, which has no `ray` scheduler of its own (distopt's takes
# the name). Its own venv: torchx-nightly and torchx install the same package, and distopt's
# `torchx>=0.7.0` would pull torchx back in, so distopt goes in without deps. Not part of `make
# test` (a second torch + ray install); its Ray head keeps its own state dir.
NIGHTLY_VENV ?= .venv-nightly
test-torchx-nightly:
	test -x $(NIGHTLY_VENV)/bin/python || python3 -m venv $(NIGHTLY_VENV)
	$(NIGHTLY_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(CONSTRAINT) \
		torch torchx-nightly 'ray[default]>=2.9' PyYAML rich tqdm numpy torcheval tensorboard \
		pytest pytest-timeout
	$(NIGHTLY_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	DISTOPT_RAY_TEST_STATE_DIR=/tmp/distopt-ray-test-nightly $(NIGHTLY_VENV)/bin/python -m pytest \
		tests/launch/test_ray_scheduler.py tests/launchers/test_ray_scheduler.py \
		tests/launchers/test_ray.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check distopt launchers tests examples
	$(VENV)/bin/mypy distopt

bench: $(STAMP)
	$(VENV)/bin/distopt bench configs/bench/optimize_overhead.yaml

clean:
	rm -rf $(VENV) $(NIGHTLY_VENV) build *.egg-info .pytest_cache
