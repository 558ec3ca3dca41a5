# `make run` and `make test` each do the whole set-up on a fresh machine first.
PYTHON ?= python3
# Python writes the bytecode of what it imports to __pycache__/, whatever the environment says: the
# suites start some hundreds of Python processes, and with PYTHONDONTWRITEBYTECODE=1 (set in many
# container images) each compiled JAX's, Flax's and mptrain's 2,000 modules anew, 2-3 s of a
# core apiece. pip installs with --no-compile below, so a module is compiled once, when first
# imported, and only the modules something imports.
export PYTHONDONTWRITEBYTECODE :=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-plan test-loggers test-gpu test-slow lint format clean

install: $(STAMP)

# What `make run` needs: mptrain and its dependencies, no extra (the default run trains on
# embedded text, so it never imports TensorFlow or pytest). `--no-compile`: Python compiles a
# module the first time it is imported, not all of TensorFlow's and JAX's files up front (13 s
# of the test extras' 51 s install on a 2-core machine).
RUN_STAMP := $(VENV)/.installed-run
$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e .
	touch $(RUN_STAMP)

# What the tests need besides: the extras test (pytest, ruff, the bucket servers, ...), tfds
# (TensorFlow), data (pyarrow, for rows in tables), s3 and gcs (the buckets' clients).
$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet --no-compile -e '.[test,tfds,data,s3,gcs]'
	touch $(STAMP)

run: $(RUN_STAMP)
	$(PY) -m mptrain.main --config=configs/default.py --workdir=runs/default

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The suite's programs are compiled by XLA's CPU backend at LLVM's -O1, not its default -O2: the
# same numbers (neither reassociates floating point without fast-math), a third less compile
# time for a train step and no slower to run at the tests' sizes; measured over five slow tests,
# 5-8% less CPU time (docs/performance.md#the-test-suites-times). tests/helpers.py's fake_cpu_env
# passes it on to the processes the tests start with other device counts.
TEST_XLA_FLAGS := --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1

test: lint
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow and not plan and not loggers" tests

# The extra mptrain[plan] (JAX's CUDA compiler plugin at the installed jax's version, cuDNN,
# libtpu), then the tests that compile for an H100 or a TPU that is not here. JAX starts on the
# CPU only, with the flag a default config's run asks for (config.deterministic).
PLAN_STAMP := $(VENV)/.installed-plan
$(PLAN_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-compile -e '.[plan]'
	touch $(PLAN_STAMP)

test-plan: $(PLAN_STAMP)
	JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_deterministic_ops=true $(PY) -m pytest -n 2 --dist loadgroup -q --durations=10 -m plan tests

# The extras mptrain[wandb] and mptrain[mlflow], then the tests that log to them for real
# without a network: W&B offline, MLflow's file store, each read back.
LOGGERS_STAMP := $(VENV)/.installed-loggers
$(LOGGERS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-compile -e '.[wandb,mlflow]'
	touch $(LOGGERS_STAMP)

test-loggers: $(LOGGERS_STAMP)
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PY) -m pytest -q -m loggers tests/record/loggers_test.py

# On a GPU machine whose Python already has what pyproject.toml lists (no venv, no network):
# the same suite on the GPU. Tests needing more devices than there are skip, naming the counts;
# those of the tfds extra skip where it is not installed. Eight workers share the GPU's memory.
test-gpu:
	XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 XLA_FLAGS=--xla_force_host_platform_device_count=8 \
	  $(PYTHON) -m pytest -n 8 --dist loadgroup -q -rs -m "not slow" tests

# Two workers, as make test: the storms' kills and Ctrl-Cs land at random moments of a step or a
# save on a loaded machine too, and the time bounds tested (a stop within 10 s) hold under load.
test-slow: $(STAMP)
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PY) -m pytest -n 2 --dist loadgroup -q --durations=20 -m slow tests

clean:
	rm -rf $(VENV) runs
