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
	$(PY) -m pytest -n 2 --durations=20 --ignore=tests/remote $(PYTEST_ARGS)
	$(PY) -m pytest -n 2 tests/remote $(PYTEST_ARGS)

# Tests that need a CUDA GPU (marked `cuda`; skipped elsewhere).
test-gpu: $(STAMP)
	$(PY) -m pytest -m cuda $(PYTEST_ARGS)

# TorchX's launch tests and the Ray tests under torchx-nightly (TORCHX_NIGHTLY), which has no
# `ray` scheduler of its own: plugins/torchx-ray gives it distopt's, and a missing one fails.
# .ci/nightly-venv builds a venv holding only torchx-nightly, this checkout's distopt and the
# plugin, over $(VENV)'s packages; its Ray head keeps its own state dir.
NIGHTLY_VENV ?= .venv-nightly
TORCHX_NIGHTLY ?= 2026.10.26
NIGHTLY_STAMP := $(NIGHTLY_VENV)/.torchx-nightly-$(TORCHX_NIGHTLY)

$(NIGHTLY_STAMP): $(STAMP) pyproject.toml plugins/torchx-ray/pyproject.toml plugins/torchx-ray/torchx_plugins/schedulers/distopt_ray.py .ci/nightly-venv
	.ci/nightly-venv $(VENV) $(NIGHTLY_VENV) $(TORCHX_NIGHTLY)
	touch $@

# On the nightly `ray` is distopt's scheduler too, so the distopt_ray runs through a bare Runner
# repeat the ray ones (distopt launch -s distopt_ray still runs): left out to keep CI near 3 min.
NIGHTLY_SAME = $(foreach t,test_real_ps_job_on_ray test_failing_trainer_fails_the_ray_job,\
	--deselect 'tests/launchers/test_ray.py::$(t)[distopt_ray]')

test-torchx-nightly: $(NIGHTLY_STAMP)
	DISTOPT_RAY_TEST_STATE_DIR=/tmp/distopt-ray-test-nightly $(NIGHTLY_VENV)/bin/python -m pytest -n 2 \
		tests/torchx tests/launchers/test_ray.py tests/launchers/test_ray_scheduler_cluster.py \
		tests/launchers/test_ray_ps_backend.py \
		$(NIGHTLY_SAME) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check distopt launchers tests examples
	$(VENV)/bin/ruff format --check distopt launchers tests examples
	$(VENV)/bin/mypy distopt

bench: $(STAMP)
	$(VENV)/bin/distopt bench configs/bench/optimize_overhead.yaml

clean:
	rm -rf $(VENV) $(NIGHTLY_VENV) build *.egg-info .pytest_cache
