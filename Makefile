# Everything installs into a repo-local virtual environment on first use, one per
# interpreter: .venv for python3, .venv-python3.13 for `make test PYTHON=python3.13`.
PYTHON ?= python3
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
# Two stamps: `make demo` installs the package alone (what `grain-replay demo` imports: jax,
# grain, zarr, h5py, ...); `make test` (and every other target) adds the extras on top.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
# Test processes (pytest-xdist; one test file per process): `make test TEST_WORKERS=auto`.
TEST_WORKERS ?= 2

.PHONY: install demo test test-slow test-lerobot test-rlds test-formats test-ray bench bench-quick bench-s3 bench-lerobot bench-peers lint docs clean

install: $(STAMP)

# One line per step; pip shows its own progress for the big one.
$(DEMO_STAMP): pyproject.toml
	@echo "==> [1/3] virtual environment in $(VENV)/"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "==> $(PYTHON) does not run. \
	A pyenv shim needs its version named: PYENV_VERSION=3.13.0 make ... PYTHON=$(PYTHON), \
	or PYTHON=\$$(pyenv prefix 3.13.0)/bin/python3.13 (.ci/run finds it itself)"; exit 1; }
	@echo "==> [2/3] upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "==> [3/3] installing grain_replay and its dependencies (jax, grain, zarr, h5py, ...): a few minutes on first use"
	$(PY) -m pip install --progress-bar on -e .
	@touch $(DEMO_STAMP)
	@echo "==> installed into $(VENV)/ (later runs skip these steps)"

# ml_dtypes 0.7.0 takes ~0.9 s to import beside numpy < 2.5 (0.08 s beside 2.5; 0.15 s for
# 0.6.0 beside 2.4), and every process that imports jax pays it: each loader worker, example
# and benchmark the tests start (tests/test_examples.py + test_rl_examples.py +
# device/test_multihost_scale.py: 72 -> 58 s on 2 cores). The test venv takes another
# release there; the package's own range is untouched, and a fixed release is taken again.
SLOW_ML_DTYPES := import sys, numpy, importlib.metadata as m; \
	sys.exit(tuple(map(int, numpy.__version__.split(".")[:2])) < (2, 5) and m.version("ml_dtypes") == "0.7.0")

$(STAMP): $(DEMO_STAMP) pyproject.toml
	@echo "==> installing the test, format and benchmark extras into $(VENV)/ (~1 GB with the above: about 3 minutes on first use)"
	$(PY) -m pip install --progress-bar on -e ".[test,s3,cli,bench,rl,fast]"
	@$(PY) -c '$(SLOW_ML_DTYPES)' || { echo "==> numpy < 2.5: ml_dtypes 0.7.0 imports in ~0.9 s; the test venv takes another release"; \
		$(PY) -m pip install --quiet "ml_dtypes!=0.7.0"; }
	@touch $(STAMP)
	@echo "==> installed into $(VENV)/ (later runs skip this step)"

demo: $(DEMO_STAMP)
	$(PY) -m grain_replay.cli demo

# Which stack this run tests, first (CI runs one leg per interpreter).
VERSIONS := import sys, importlib.metadata as m; print("==> versions: " + ", ".join( \
	[f"python {sys.version.split()[0]}"] + [f"{p} {m.version(p)}" for p in \
	("jax", "jaxlib", "numpy", "ml_dtypes", "zarr", "grain")]))

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
		tests/datasets/test_lerobot_peer.py tests/datasets/test_lerobot.py

# TensorFlow + tensorflow-datasets (only to write and read back the RLDS peer datasets) in a
# venv of their own; grain_replay reads RLDS without them. tensorflow-cpu 2.21 needs Python 3.11+.
RLDS_VENV ?= .venv-rlds
RLDS_STAMP := $(RLDS_VENV)/.installed

$(RLDS_STAMP):
	test -x $(RLDS_VENV)/bin/python || $(PYTHON) -m venv $(RLDS_VENV)
	$(RLDS_VENV)/bin/python -m pip install --quiet "tensorflow-cpu==2.21.0" \
		"tensorflow-datasets==4.9.10" pillow
	touch $(RLDS_STAMP)

test-rlds: $(STAMP) $(RLDS_STAMP)
	RLDS_PYTHON=$(abspath $(RLDS_VENV))/bin/python $(PY) -m pytest -q \
		tests/datasets/test_rlds_peer.py tests/datasets/test_rlds_source.py

# torch, torchrl and flashbax in a venv of their own: they write real buffer dumps and Vaults,
# and the main venv's tests compare our reads with theirs (FORMATS_PYTHON, formats_peer.py).
FORMATS_VENV ?= .venv-formats
FORMATS_STAMP := $(FORMATS_VENV)/.installed

$(FORMATS_STAMP):
	test -x $(FORMATS_VENV)/bin/python || $(PYTHON) -m venv $(FORMATS_VENV)
	$(FORMATS_VENV)/bin/python -m pip install --quiet "torch==2.13.0" "torchrl==0.14.1" tensordict flashbax
	touch $(FORMATS_STAMP)

test-formats: $(STAMP) $(FORMATS_STAMP)
	FORMATS_PYTHON=$(abspath $(FORMATS_VENV))/bin/python $(PY) -m pytest -q -n 0 \
		tests/datasets/test_formats_peer.py tests/sources/test_npz_source.py \
		tests/datasets/test_torchrl_source.py tests/datasets/test_vault_source.py

# Ray in a venv of its own (Python 3.11): examples/ray_actors.py runs there, its actors
# writing one store beside a JAX learner; the main venv's test drives it through RAY_PYTHON
# (tests/test_example_ray.py skips in `make test`). The package goes in editable, with the s3
# extra so that `--store s3://...` needs nothing more.
RAY_VENV ?= .venv-ray
RAY_STAMP := $(RAY_VENV)/.installed
RAY_BASE_PYTHON ?= python3.11

$(RAY_STAMP): pyproject.toml
	test -x $(RAY_VENV)/bin/python || $(RAY_BASE_PYTHON) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(RAY_VENV)/bin/python -m pip install --quiet -e ".[s3]" "ray>=2.60"
	touch $(RAY_STAMP)

test-ray: $(STAMP) $(RAY_STAMP)
	RAY_PYTHON=$(abspath $(RAY_VENV))/bin/python $(PY) -m pytest -q -n 0 tests/test_example_ray.py

# The site (docs/, mkdocs.yml) in a venv of its own: the `docs` extra's packages only, read from
# pyproject.toml; mkdocstrings reads the docstrings from the source, so neither the package
# nor jax is installed there. --strict: any warning (a broken link, a bad docstring) fails.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed

$(DOCS_STAMP): pyproject.toml
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install --quiet $$($(DOCS_VENV)/bin/python -c 'import tomllib; \
		print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --site-dir site
	@echo "==> site/index.html"

bench-lerobot: $(STAMP) $(LEROBOT_STAMP)
	$(PY) benchmarks/bench_lerobot.py --peer-python $(abspath $(LEROBOT_VENV))/bin/python

bench: $(STAMP)
	$(PY) benchmarks/run.py

bench-quick: $(STAMP)
	$(PY) benchmarks/run.py --quick

bench-s3: $(STAMP)
	$(PY) benchmarks/bench_s3.py

# torchrl and flashbax (which pulls torch and its own jax) live in a repo-local venv of
# their own (git-ignored, like .venv-lerobot/). torchrl's prioritized sampler is its C++
# extension, built against one torch: torchrl 0.14.1's loads on torch 2.14.1 and fails
# on 2.13.0+cpu (undefined symbol torch::autograd::_wrap_outputs; torchrl ships no sdist
# to build it against another torch). torch 2.14.1 is a CUDA build (~5.5 GB in the venv,
# taken from this machine's disk where it lies there; it runs on the CPU). The last step
# fails the install when the extension does not load.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_TORCH ?= torch==2.14.1

$(PEERS_STAMP):
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet "$(PEERS_TORCH)" "torchrl==0.14.1" "tensordict>=0.14.3,<0.15" flashbax numpy
	$(PEERS_VENV)/bin/python -c "from torchrl._torchrl import SumSegmentTreeFp32; SumSegmentTreeFp32(8)" \
		|| { echo "==> torchrl's C++ extension does not load beside $(PEERS_TORCH): pick the torch its wheel was built for"; exit 1; }
	touch $(PEERS_STAMP)

bench-peers: $(STAMP) $(PEERS_STAMP)
	$(PY) benchmarks/bench_sampling.py --peers-python $(abspath $(PEERS_VENV))/bin/python

# The online loop against Reverb (a server on 127.0.0.1; dm-reverb 0.14.0 wants Python 3.11
# and tensorflow 2.15) and torchrl (from .venv-peers): a repo-local venv of its own.
REVERB_VENV ?= .venv-reverb
REVERB_STAMP := $(REVERB_VENV)/.installed

$(REVERB_STAMP):
	test -x $(REVERB_VENV)/bin/python || $(PYTHON) -m venv $(REVERB_VENV)
	$(REVERB_VENV)/bin/python -m pip install --quiet "dm-reverb==0.14.0" "tensorflow==2.15.*" numpy
	touch $(REVERB_STAMP)

.PHONY: bench-online-peers
bench-online-peers: $(STAMP) $(PEERS_STAMP) $(REVERB_STAMP)
	$(PY) benchmarks/bench_online.py --reverb-python $(abspath $(REVERB_VENV))/bin/python \
		--torchrl-python $(abspath $(PEERS_VENV))/bin/python

# Wheels for benchmarks/accelerator_check.sh on a TPU or GPU machine with its own jax and no
# network: the packages grain_replay needs that such a machine lacks, pinned to what a TPU v5e
# run used and downloaded without dependencies (the list is the whole closure), for
# PYTHON_VERSION (default 3.11, the TPU v5e host's: `make accelerator-wheels PYTHON_VERSION=3.12`;
# set with := so that a PYTHON_VERSION in the environment does not change it), and this
# package's wheel. The script installs only what that machine lacks, never jax, jaxlib,
# libtpu or numpy. gpu-wheels and gpu-check-cpu are the old names (gpu-wheels: Python 3.12).
.PHONY: accelerator-wheels accelerator-check-cpu gpu-wheels gpu-check-cpu
ACCELERATOR_WHEELS ?= .accelerator-wheels
PYTHON_VERSION := 3.11
GPU_PYTHON_VERSION ?= 3.12
# grain's wheels are manylinux_2_28: manylinux2014 alone finds none of its recent releases.
ACCELERATOR_PLATFORMS ?= manylinux2014_x86_64 manylinux_2_28_x86_64
ACCELERATOR_WHEEL_PACKAGES ?= grain==0.2.18 array-record==0.8.6 etils==1.15.0 \
	cloudpickle==3.1.3 portpicker==1.6.0 protobuf==7.36.2 zarr==3.1.6 numcodecs==0.16.6 \
	donfig==0.8.1.post1 google-crc32c==1.9.0 crc32c==2.9.post0 deflate==0.9.0 \
	typing-extensions==4.16.0 flashbax==0.1.3 chex==0.1.92 toolz==1.2.0
ACCELERATOR_WHEELS_MAX_MB := 64

accelerator-wheels: $(STAMP)
	rm -rf $(ACCELERATOR_WHEELS) && mkdir -p $(ACCELERATOR_WHEELS)
	$(PY) -m pip download --quiet --only-binary=:all: --python-version $(PYTHON_VERSION) \
		$(addprefix --platform ,$(ACCELERATOR_PLATFORMS)) --no-deps -d $(ACCELERATOR_WHEELS) \
		$(ACCELERATOR_WHEEL_PACKAGES)
	$(PY) -m pip wheel --quiet --no-deps -w $(ACCELERATOR_WHEELS) .
	@du -sm $(ACCELERATOR_WHEELS) | awk '{ if ($$1 > $(ACCELERATOR_WHEELS_MAX_MB)) { print "$(ACCELERATOR_WHEELS): " $$1 " MB, over $(ACCELERATOR_WHEELS_MAX_MB) MB"; exit 1 } else print "$(ACCELERATOR_WHEELS): " $$1 " MB of wheels for Python $(PYTHON_VERSION)" }'

# The script's whole path on this machine's CPU at toy sizes (this venv stands in for the
# accelerator machine's interpreter; the targets are printed, not judged).
accelerator-check-cpu: $(STAMP)
	benchmarks/accelerator_check.sh --cpu --python $(PY) --carry $(ACCELERATOR_WHEELS) \
		--out bench_out/accelerator-cpu

gpu-wheels: PYTHON_VERSION = $(GPU_PYTHON_VERSION)
gpu-wheels: accelerator-wheels
gpu-check-cpu: accelerator-check-cpu

lint: $(STAMP)
	$(VENV)/bin/ruff check grain_replay tests examples benchmarks
	$(VENV)/bin/ruff format --check grain_replay tests examples benchmarks
	$(VENV)/bin/mypy grain_replay

clean:
	rm -rf $(VENV) .venv-peers .venv-docs .venv-ray .gpu-wheels .accelerator-wheels build *.egg-info demo_out bench_out site
