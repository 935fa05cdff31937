# Everything installs into a repo-local virtual environment on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
# Test processes (pytest-xdist; one test file per process): `make test TEST_WORKERS=auto`.
TEST_WORKERS ?= 2

.PHONY: install demo test test-slow bench bench-quick bench-s3 lint clean

install: $(STAMP)

# One line per step; pip shows its own progress for the big one.
$(STAMP): pyproject.toml
	@echo "==> [1/3] virtual environment in $(VENV)/"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> [2/3] upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "==> [3/3] installing grain_replay and ~1 GB of dependencies (jax, grain, zarr, h5py, ...): about 3 minutes on first use"
	$(PY) -m pip install --progress-bar on -e ".[test,s3,cli,bench,rl,fast]"
	@touch $(STAMP)
	@echo "==> installed into $(VENV)/ (later runs skip these steps)"

demo: $(STAMP)
	$(PY) -m grain_replay.cli demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

bench-quick: $(STAMP)
	$(PY) benchmarks/run.py --quick

bench-s3: $(STAMP)
	$(PY) benchmarks/bench_s3.py

lint: $(STAMP)
	$(VENV)/bin/ruff check grain_replay tests examples benchmarks
	$(VENV)/bin/ruff format --check grain_replay tests examples benchmarks
	$(VENV)/bin/mypy grain_replay

clean:
	rm -rf $(VENV) build *.egg-info demo_out bench_out
