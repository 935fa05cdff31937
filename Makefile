# Everything installs into a repo-local virtual environment on first use, one per
# interpreter: .venv for python3, .venv-python3.13 for `make test PYTHON=python3.13`.
PYTHON ?= python3
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
# Test processes (pytest-xdist; one test file per process): `make test TEST_WORKERS=auto`.
TEST_WORKERS ?= 2

.PHONY: install demo test test-slow test-lerobot bench bench-quick bench-s3 bench-lerobot bench-peers lint clean

install: $(STAMP)

# One line per step; pip shows its own progress for the big one.
$(STAMP): pyproject.toml
	@echo "==> [1/3] virtual environment in $(VENV)/"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "==> $(PYTHON) does not run. \
	A pyenv shim needs its version named: PYENV_VERSION=3.13.0 make ... PYTHON=$(PYTHON), \
	or PYTHON=\$$(pyenv prefix 3.13.0)/bin/python3.13 (.ci/run finds it itself)"; exit 1; }
	@echo "==> [2/3] upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "==> [3/3] installing grain_replay and ~1 GB of dependencies (jax, grain, zarr, h5py, ...): about 3 minutes on first use"
	$(PY) -m pip install --progress-bar on -e ".[test,s3,cli,bench,rl,fast]"
	@touch $(STAMP)
	@echo "==> installed into $(VENV)/ (later runs skip these steps)"

demo: $(STAMP)
	$(PY) -m grain_replay.cli demo

# Which stack this run tests, first (CI runs one leg per interpreter).
VERSIONS := import sys, importlib.metadata as m; print("==> versions: " + ", ".join( \
	[f"python {sys.version.split()[0]}"] + [f"{p} {m.version(p)}" for p in \
	("jax", "jaxlib", "numpy", "zarr", "grain")]))

test: $(STAMP)
	@$(PY) -c '$(VERSIONS)'
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q

# LeRobot (and torch) in a venv of their own; the main venv's tests drive it through
# LEROBOT_PYTHON (tests/helpers/lerobot_peer.py runs there).
LEROBOT_VENV ?= .venv-lerobot
LEROBOT_STAMP := $(LEROBOT_VENV)/.installed

$(LEROBOT_STAMP):
	test -x $(LEROBOT_VENV)/bin/python || $(PYTHON) -m venv $(LEROBOT_VENV)
	$(LEROBOT_VENV)/bin/python -m pip install --quiet "lerobot==0.4.4"
	touch $(LEROBOT_STAMP)

test-lerobot: $(STAMP) $(LEROBOT_STAMP)
	LEROBOT_PYTHON=$(abspath $(LEROBOT_VENV))/bin/python $(PY) -m pytest -q \
		tests/rl/test_lerobot_peer.py tests/rl/test_lerobot.py

bench-lerobot: $(STAMP) $(LEROBOT_STAMP)
	$(PY) benchmarks/bench_lerobot.py --peer-python $(abspath $(LEROBOT_VENV))/bin/python

bench: $(STAMP)
	$(PY) benchmarks/run.py

bench-quick: $(STAMP)
	$(PY) benchmarks/run.py --quick

bench-s3: $(STAMP)
	$(PY) benchmarks/bench_s3.py

# torchrl and flashbax (which pulls torch and its own jax) live in their own venv.
PEERS_VENV ?= /work/venvs/peers
$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet torchrl flashbax numpy
	touch $(PEERS_VENV)/.installed

bench-peers: $(STAMP) $(PEERS_VENV)/.installed
	$(PY) benchmarks/bench_sampling.py --peers-python $(PEERS_VENV)/bin/python

lint: $(STAMP)
	$(VENV)/bin/ruff check grain_replay tests examples benchmarks
	$(VENV)/bin/ruff format --check grain_replay tests examples benchmarks
	$(VENV)/bin/mypy grain_replay

clean:
	rm -rf $(VENV) build *.egg-info demo_out bench_out
