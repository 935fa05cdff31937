# Everything installs into a repo-local virtual environment on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: install demo test test-slow bench bench-quick bench-s3 lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,s3,cli,bench,rl,fast]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m grain_replay.cli demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

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
