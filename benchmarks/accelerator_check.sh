#!/usr/bin/env bash
# Issue 41's accelerator targets on a TPU or GPU machine that has its own jax and no network.
#
# Installs the carried wheels (`make accelerator-wheels` builds them on a machine with
# network, for Python 3.11 by default) that the machine lacks with
# `pip install --no-deps --target OUT/site`, and runs everything with
# PYTHONPATH=<the machine's site-packages>:OUT/site, so the machine's jax, jaxlib, libtpu
# and numpy are always the ones imported (it stops if their versions moved). h5py,
# absl-py, pyyaml and tqdm, where the machine lacks them, come from --index-url. It detects
# jax's backend once, then runs, strictly one process at a time (libtpu lets one process
# hold a TPU), each under its own timeout: bench_feed.py, bench_device_replay.py --peers,
# bench_device_writes.py and run.py --sections device; then prints one table of every
# target with its ratio, judged on an accelerator (on CPU printed, not judged).
#
# Usage: benchmarks/accelerator_check.sh [--carry DIR] [--python PY] [--out DIR]
#          [--index-url URL] [--index-packages LIST] [--cpu] [--dry-run] [--timeout S]
#          [--repeats N] [--transitions N] [--image-records N] [--batch-size N] [--target-s S]
#          [--only STEPS]
#   --carry DIR      the wheels (default: .accelerator-wheels/ beside benchmarks/)
#   --python PY      the machine's interpreter, the one with jax (default: python3)
#   --out DIR        results, logs and the install (default: bench_out/accelerator)
#   --index-url URL  where h5py, absl-py, pyyaml, tqdm come from when the machine lacks
#                    them (default file:///opt/pypi/simple where that folder exists; '' none)
#   --index-packages LIST  what may come from there (default "h5py absl-py pyyaml tqdm")
#   --peer-packages LIST   what the peers need from there where the machine lacks it, best
#                    effort (default: flashbax's flax and what importing flax needs: "flax
#                    msgpack optax rich treescope markdown-it-py mdurl pygments"); if it cannot
#                    be installed, bench_device_replay --peers skips flashbax and says why
#   --cpu            everything on CPU (JAX_PLATFORMS=cpu) at toy sizes (--quick): the path
#                    without an accelerator; targets printed, not judged
#   --dry-run        print the plan (what it installs, the PYTHONPATH, each step in order);
#                    install, detect and run nothing
#   --timeout S      seconds each benchmark may run (default 1800; 900 with --cpu)
#   --repeats N      repeats of every benchmark (default 3)
#   --only STEPS     run only these steps (comma-separated: bench_feed, bench_device_replay,
#                    bench_device_writes, device_section); the other steps' results already in
#                    OUT are kept and summarized, so one OUT fills over several invocations (a
#                    machine that limits a command's time)
#   the rest: the device section's sizes (run.py's flags of the same names)
# Results: OUT/feed.json, device_replay.json, device_writes.json, device/results.json,
# logs/NAME.log, runs.tsv, summary.md. Exit status: 0 every benchmark ran (a missed target is
# a finding, printed); 2 bad usage or no wheels; 3 the carry holds jax/jaxlib/libtpu/numpy or
# their versions moved; 4 an install or import failed; 5 no accelerator (without --cpu) or
# the backend could not be detected; 6 a benchmark failed or timed out (the table still printed).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
CARRY="$ROOT/.accelerator-wheels"
PY=python3
OUT="$ROOT/bench_out/accelerator"
INDEX_URL=""
[ -d /opt/pypi/simple ] && INDEX_URL="file:///opt/pypi/simple"
CPU=0
DRY=0
TIMEOUT=""
REPEATS=3
TRANSITIONS=""
IMAGES=""
BATCH=""
TARGET_S=""
HOST_EXTRAS=(h5py absl-py pyyaml tqdm)
PEER_EXTRAS=(flax msgpack optax rich treescope markdown-it-py mdurl pygments)
ONLY=""
STEPS="bench_feed bench_device_replay bench_device_writes device_section"

die() { echo "accelerator_check: $2" >&2; exit "$1"; }
# What runs is the machine's packages and the carried wheels, never a checkout on PYTHONPATH.
# The machine's own PYTHONPATH may be where its jax lives (a TPU host's image: kept, first);
# a folder holding a grain_replay package (a checkout) is dropped from it.
KEEP_PATH=""
IFS=: read -r -a _entries <<< "${PYTHONPATH:-}"
for _d in "${_entries[@]}"; do
  [ -n "$_d" ] && [ ! -e "$_d/grain_replay/__init__.py" ] && KEEP_PATH="${KEEP_PATH:+$KEEP_PATH:}$_d"
done
if [ -n "$KEEP_PATH" ]; then export PYTHONPATH="$KEEP_PATH"; else unset PYTHONPATH; fi
while [ $# -gt 0 ]; do
  case "$1" in
    --carry|--python|--out|--index-url|--index-packages|--peer-packages|--timeout|--repeats|--transitions|--image-records|--batch-size|--target-s|--only)
      [ $# -ge 2 ] || die 2 "$1 needs a value (see --help)" ;;&
    --carry) CARRY="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --index-url) INDEX_URL="$2"; shift 2 ;;
    --index-packages) read -r -a HOST_EXTRAS <<< "$2"; shift 2 ;;
    --peer-packages) read -r -a PEER_EXTRAS <<< "$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --repeats) REPEATS="$2"; shift 2 ;;
    --transitions) TRANSITIONS="$2"; shift 2 ;;
    --image-records) IMAGES="$2"; shift 2 ;;
    --batch-size) BATCH="$2"; shift 2 ;;
    --target-s) TARGET_S="$2"; shift 2 ;;
    --only) ONLY="${2//,/ }"; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die 2 "unknown argument $1 (see --help)" ;;
  esac
done
for pair in "--timeout:$TIMEOUT" "--repeats:$REPEATS" "--transitions:$TRANSITIONS" \
            "--image-records:$IMAGES" "--batch-size:$BATCH"; do
  v="${pair#*:}"
  [ -z "$v" ] || [[ "$v" =~ ^[1-9][0-9]*$ ]] || die 2 "${pair%%:*} $v is not a positive whole number. Fix: e.g. ${pair%%:*} 3."
done
for step in $ONLY; do
  case " $STEPS " in *" $step "*) ;; *) die 2 "--only: no step $step. Fix: name some of: ${STEPS// /, }." ;; esac
done
[ -z "$TIMEOUT" ] && TIMEOUT=$([ "$CPU" = 1 ] && echo 900 || echo 1800)

command -v "$PY" >/dev/null 2>&1 || die 2 "no interpreter $PY. Fix: pass --python PATH (the one with jax)."
command -v timeout >/dev/null 2>&1 || die 2 "no 'timeout' command (coreutils). Fix: install coreutils; each benchmark runs under one."
ls "$CARRY"/*.whl >/dev/null 2>&1 || die 2 "no wheels in $CARRY. Fix: run 'make accelerator-wheels' on a machine with network, and carry $CARRY along."
CARRY="$(cd "$CARRY" && pwd)"
OUT="$(realpath -m "$OUT")"
SITE="$OUT/site"
# Never in the checkout: `python -c` and `python -` put the working directory on sys.path.
if [ "$DRY" = 1 ]; then cd /; else mkdir -p "$OUT" && cd "$OUT"; fi

# The versions that must not move; importing jax does not touch the accelerator (only
# jax.devices() and the like start a backend).
VERSIONS='import importlib.metadata as m, os
import jax, jaxlib, numpy
def v(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return "-"
where = os.path.dirname(os.path.dirname(jax.__file__))
tpu, nightly = v("libtpu"), v("libtpu-nightly")
print(f"jax={jax.__version__} jaxlib={jaxlib.__version__} libtpu={tpu} "
      f"libtpu-nightly={nightly} numpy={numpy.__version__} (jax from {where})")'
echo "==> the machine's interpreter: $PY"
BEFORE="$("$PY" -c "$VERSIONS")" \
  || die 4 "$PY cannot import jax, jaxlib and numpy (above). Fix: pass --python PATH, the interpreter that has the machine's own jax."
echo "    python $("$PY" -c 'import platform; print(platform.python_version())'): $BEFORE"
MACHINE_SITE="$("$PY" -c 'import sys; print(":".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))')"
[ -n "$MACHINE_SITE" ] || die 4 "$PY has no site-packages on sys.path. Fix: pass --python PATH, the interpreter that has the machine's own jax."
# The machine's site-packages first, the carried packages last: a carried wheel never
# shadows one of the machine's.
RUN_PATH="${KEEP_PATH:+$KEEP_PATH:}$MACHINE_SITE:$SITE"

# Which carried wheels to install: each whose package the machine lacks, and grain_replay
# always (the code under test). A carried jax, jaxlib, libtpu or numpy is refused.
PLAN="$("$PY" - "$CARRY" "${HOST_EXTRAS[@]}" <<'PY'
import importlib.metadata as md
import os
import re
import sys

carry, extras = sys.argv[1], sys.argv[2:]
never = {"jax", "jaxlib", "libtpu", "libtpu-nightly", "numpy"}
here = sys.version_info[:2]


def key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def for_this_python(name: str) -> bool:
    """The wheel's Python tag admits this interpreter (py3, cpXY, or cpXY-abi3 for XY <= ours)."""
    py, abi = name[: -len(".whl")].split("-")[-3:-1]
    for tag in py.split("."):
        m = re.fullmatch(r"cp(\d)(\d+)", tag)
        if tag.startswith("py") or (m and (int(m[1]), int(m[2])) == here):
            return True
        if m and abi == "abi3" and (int(m[1]), int(m[2])) <= here:
            return True
    return False


def have(k: str) -> str | None:
    try:
        return md.version(k)
    except md.PackageNotFoundError:
        return None


carried = set()
for name in sorted(os.listdir(carry)):
    if not name.endswith(".whl"):
        continue
    dist, version = name.split("-")[:2]
    k = key(dist)
    if k == "grain-replay":
        print(f"install {name} grain_replay {version} (the code under test)")
    elif k in never:
        print(f"refuse {name} {k}: the machine's own {k} is never replaced")
    elif have(k) is not None:
        print(f"keep {name} {k} {have(k)} is the machine's (carried {version})")
    elif not for_this_python(name):
        print(f"skip {name} {k}: built for another Python than {here[0]}.{here[1]}")
    else:
        print(f"install {name} {k} {version}")
        carried.add(k)
for k in map(key, extras):
    if have(k) is None and k not in carried:
        print(f"index {k} (the machine lacks it)")
PY
)"
echo "==> carried wheels ($CARRY)"
grep -v '^index ' <<< "$PLAN" | sed 's/^/    /' || true
grep -q '^refuse ' <<< "$PLAN" && die 3 "the carry folder holds jax, jaxlib, libtpu or numpy: those stay the machine's. Fix: rebuild it with 'make accelerator-wheels' (or delete those wheels)."
grep -q '^install .*grain_replay' <<< "$PLAN" || die 2 "no grain_replay wheel in $CARRY. Fix: make accelerator-wheels."
mapfile -t WHEELS < <(awk -v d="$CARRY/" '$1 == "install" {print d $2}' <<< "$PLAN")
mapfile -t FROM_INDEX < <(awk '$1 == "index" {print $2}' <<< "$PLAN")
# The peers' packages the machine lacks (best effort: without them flashbax is skipped).
mapfile -t PEER_FROM_INDEX < <("$PY" - "${PEER_EXTRAS[@]}" <<'PY'
import importlib.metadata as md
import sys
for name in sys.argv[1:]:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(name)
PY
)
if [ "${#FROM_INDEX[@]}" -gt 0 ]; then
  if [ -n "$INDEX_URL" ]; then
    echo "==> the machine lacks ${FROM_INDEX[*]}: from $INDEX_URL"
  else
    echo "==> the machine lacks ${FROM_INDEX[*]} and no --index-url is given: the import check says if any is needed"
  fi
else
  echo "==> the machine has ${HOST_EXTRAS[*]}"
fi

# pip from the machine's interpreter, its configuration ignored (the install uses only what
# is named here), into OUT/site alone.
PIP=(env PIP_CONFIG_FILE=/dev/null "$PY" -m pip --isolated --disable-pip-version-check)
INSTALL=("${PIP[@]}" install --quiet --no-deps --no-index --target "$SITE")
EXTRA=("${PIP[@]}" install --quiet --no-deps --target "$SITE" --index-url "$INDEX_URL")

# The benchmarks, in this order; each one alone on the machine (see run_step).
QUICK=()
[ "$CPU" = 1 ] && QUICK=(--quick)
B="$ROOT/benchmarks"
FEED=("$B/bench_feed.py" "${QUICK[@]}" --repeats "$REPEATS" --out "$OUT/feed.json")
REPLAY=("$B/bench_device_replay.py" --peers "${QUICK[@]}" --repeats "$REPEATS" --out "$OUT/device_replay.json")
WRITES=("$B/bench_device_writes.py" "${QUICK[@]}" --repeats "$REPEATS" --out "$OUT/device_writes.json")
if [ "$CPU" = 1 ]; then  # toy sizes: seconds, not minutes, per case on a CPU
  : "${TRANSITIONS:=2000}" "${IMAGES:=200}" "${BATCH:=16}" "${TARGET_S:=0.002}"
else
  : "${TRANSITIONS:=200000}" "${IMAGES:=20000}"
fi
DEVICE=("$B/run.py" --sections device "${QUICK[@]}" --transitions "$TRANSITIONS" --image-records "$IMAGES" --repeats "$REPEATS" --out "$OUT/device")
[ -n "$BATCH" ] && DEVICE+=(--batch-size "$BATCH")
[ -n "$TARGET_S" ] && DEVICE+=(--target-s "$TARGET_S")
SUMMARY=("$B/accelerator_summary.py" "$OUT" --md "$OUT/summary.md")
ENV_SHOWN="PYTHONPATH=$RUN_PATH"
[ "$CPU" = 1 ] && ENV_SHOWN+=" JAX_PLATFORMS=cpu"

skipped() { # a step's note in the plan when --only leaves it out
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]]; then echo " (not in --only: not run)"; fi
}
if [ "$DRY" = 1 ]; then
  echo "==> dry run: nothing installed, detected or run. The plan, in order:"
  echo "step 1: install: ${INSTALL[*]} ${WHEELS[*]}"
  if [ "${#FROM_INDEX[@]}" -gt 0 ] && [ -n "$INDEX_URL" ]; then
    echo "step 2: install from the index: ${EXTRA[*]} ${FROM_INDEX[*]}"
  elif [ "${#FROM_INDEX[@]}" -gt 0 ]; then
    echo "step 2: install from the index: nothing, no --index-url (lacking ${FROM_INDEX[*]})"
  else
    echo "step 2: install from the index (${INDEX_URL:-none}): nothing, the machine has ${HOST_EXTRAS[*]}"
  fi
  if [ "${#PEER_FROM_INDEX[@]}" -gt 0 ] && [ -n "$INDEX_URL" ]; then
    echo "        and, best effort, for the peers (flashbax): ${PEER_FROM_INDEX[*]}"
  fi
  echo "step 3: environment of every later step: $ENV_SHOWN"
  echo "        (sys.path: the machine's site-packages first, then $SITE)"
  echo "step 4: check jax, jaxlib, libtpu, numpy unchanged ($BEFORE); import grain, zarr, h5py, grain_replay (from $SITE)"
  echo "step 5: detect the backend once: $PY -c \"import jax; print(jax.default_backend())\""
  echo "one process at a time: each step starts after the one before has exited (libtpu lets one process hold a TPU); nothing else may use the accelerator meanwhile"
  [ -n "$ONLY" ] && echo "only: $ONLY (the other steps' results in $OUT are kept)"
  echo "step 6: bench_feed, timeout ${TIMEOUT}s: $PY ${FEED[*]}$(skipped bench_feed)"
  echo "step 7: bench_device_replay, timeout ${TIMEOUT}s: $PY ${REPLAY[*]}$(skipped bench_device_replay)"
  echo "step 8: bench_device_writes, timeout ${TIMEOUT}s: $PY ${WRITES[*]}$(skipped bench_device_writes)"
  echo "step 9: device_section, timeout ${TIMEOUT}s: $PY ${DEVICE[*]}$(skipped device_section)"
  echo "step 10: summary (no jax): $PY ${SUMMARY[*]} --backend BACKEND"
  exit 0
fi

echo "==> installing into $SITE (the machine's packages are not touched)"
rm -rf "$SITE" && mkdir -p "$SITE"
"${PIP[@]}" --version >/dev/null 2>&1 \
  || die 4 "$PY has no pip. Fix: '$PY -m ensurepip --user' (offline), or pass --python an interpreter with pip."
"${INSTALL[@]}" "${WHEELS[@]}" \
  || die 4 "pip could not install the carried wheels into $SITE (its message is above). Fix: rebuild the carry for this Python with 'make accelerator-wheels PYTHON_VERSION=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')'."
if [ "${#FROM_INDEX[@]}" -gt 0 ] && [ -n "$INDEX_URL" ]; then
  "${EXTRA[@]}" "${FROM_INDEX[@]}" \
    || die 4 "pip could not install ${FROM_INDEX[*]} from $INDEX_URL. Fix: pass --index-url a local index that has them, or carry their wheels in $CARRY."
fi
if [ "${#PEER_FROM_INDEX[@]}" -gt 0 ] && [ -n "$INDEX_URL" ]; then
  "${EXTRA[@]}" "${PEER_FROM_INDEX[@]}" \
    || echo "==> warning: pip could not install ${PEER_FROM_INDEX[*]} from $INDEX_URL (above): bench_device_replay --peers skips flashbax"
fi
export PYTHONPATH="$RUN_PATH"
[ "$CPU" = 1 ] && export JAX_PLATFORMS=cpu
AFTER="$("$PY" -c "$VERSIONS")"
[ "$AFTER" = "$BEFORE" ] || die 3 "the machine's versions moved: before the install $BEFORE, with it $AFTER. Fix: remove from $CARRY the wheel that brings them (the run imports the machine's own jax)."
echo "==> unchanged: $AFTER"
"$PY" - "$SITE" <<'PY' || die 4 "an import failed with the carried wheels (the error is above). Fix: rebuild the carry with 'make accelerator-wheels', or pass --index-url for what the machine lacks."
import sys
import grain, h5py, zarr, grain_replay
here = grain_replay.__file__
if not here.startswith(sys.argv[1]):
    sys.exit(f"grain_replay imported from {here}, not the carried wheel in {sys.argv[1]}: "
             "the machine has a grain_replay of its own. Fix: uninstall it there, or run "
             "with another --python.")
print(f"    grain_replay {grain_replay.__version__} ({here}), zarr {zarr.__version__}, h5py {h5py.__version__}")
try:
    import flashbax
    print(f"    flashbax {flashbax.__version__ if hasattr(flashbax, '__version__') else '?'}")
except ImportError as e:
    print(f"    flashbax does not import ({e}): bench_device_replay --peers skips it")
PY

echo "==> detecting jax's backend (one process, which exits before the benchmarks start)"
BACKEND="$("$PY" -c 'import jax; print(jax.default_backend())' 2> "$OUT/backend.err")" || {
  tail -n 20 "$OUT/backend.err" >&2
  die 5 "jax could not start its backend (above). Fix: if another process holds the TPU (libtpu allows one: see 'lsof -w /dev/accel*' or /tmp/libtpu_lockfile), let it end first; or pass --cpu."
}
BACKEND="$(echo "$BACKEND" | tail -n 1)"
case "$BACKEND" in
  tpu) echo "    TPU: libtpu lets one process hold the chip, so the benchmarks run one after another; run nothing else on it until this ends" ;;
  gpu|cuda|rocm) echo "    GPU ($BACKEND): the benchmarks run one after another, alone on it" ;;
  cpu)
    [ "$CPU" = 1 ] || die 5 "jax's backend is cpu: no accelerator is visible (JAX_PLATFORMS=${JAX_PLATFORMS:-unset}). Fix: check the accelerator and its jax (libtpu, CUDA), or pass --cpu to run the toy path on CPU."
    echo "    CPU (--cpu): toy sizes; the targets are printed, not judged" ;;
  *) echo "    backend $BACKEND: the targets are judged only on tpu or gpu" ;;
esac

mkdir -p "$OUT/logs"
# With --only, the runs of earlier invocations stay listed (their results are summarized too).
[ -n "$ONLY" ] || : > "$OUT/runs.tsv"
touch "$OUT/runs.tsv"
FAILED=0
# One benchmark, in the foreground, alone: the next starts only after it (and every process
# it started: timeout signals its whole process group) has exited.
run_step() {
  local name="$1" result="$2"; shift 2
  local start=$SECONDS rc
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
    echo "==> $name: not in --only; its earlier result, if any, is summarized"
    return
  fi
  if [ -n "$ONLY" ]; then  # this step's earlier run is replaced by this one
    awk -F'\t' -v n="$name" '$1 != n' "$OUT/runs.tsv" > "$OUT/runs.tsv.new" && mv "$OUT/runs.tsv.new" "$OUT/runs.tsv"
  fi
  rm -f "$result"  # a file left by an earlier run is not this run's result
  echo "==> $name (timeout ${TIMEOUT}s): $PY $*"
  set +e
  timeout --kill-after=30 "$TIMEOUT" "$PY" "$@" 2>&1 | tee "$OUT/logs/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/runs.tsv"
  case "$rc" in
    0) ;;
    124|137) echo "==> $name timed out after ${TIMEOUT}s (log: $OUT/logs/$name.log)"; FAILED=1 ;;
    *) echo "==> $name failed, exit status $rc (log: $OUT/logs/$name.log)"; FAILED=1 ;;
  esac
}
run_step bench_feed "$OUT/feed.json" "${FEED[@]}"
run_step bench_device_replay "$OUT/device_replay.json" "${REPLAY[@]}"
run_step bench_device_writes "$OUT/device_writes.json" "${WRITES[@]}"
run_step device_section "$OUT/device/results.json" "${DEVICE[@]}"

echo "==> summary ($OUT/summary.md)"
set +e
"$PY" "${SUMMARY[@]}" --backend "$BACKEND"
SUMMARY_RC=$?
set -e
AFTER="$("$PY" -c "$VERSIONS")"
[ "$AFTER" = "$BEFORE" ] || die 3 "the machine's versions moved during the run: $BEFORE, now $AFTER."
[ "$SUMMARY_RC" = 0 ] || die 4 "the summary could not read every result (above)."
[ "$FAILED" = 0 ] || die 6 "a benchmark failed or timed out (see runs.tsv and logs/); its rows say so."
echo "==> done: $OUT"
