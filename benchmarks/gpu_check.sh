#!/usr/bin/env bash
# The device benchmarks on a GPU machine that has its own jax and no network.
#
# Installs the wheels it carries (`make gpu-wheels` builds them here, for Python 3.12:
# grain and zarr with their dependencies, and grain_replay) into a
# throwaway venv that sees every package of the machine's interpreter, so nothing of the
# machine's own is replaced: a carried wheel of a package the machine has is skipped
# (jax, numpy, ... stay the machine's), and the run stops if jax's version moved. Then
# runs the device section (benchmarks/run.py --sections device) and prints every GPU
# target with its ratio (judged on a GPU; on CPU printed, not judged).
#
# Usage: benchmarks/gpu_check.sh [--carry DIR] [--python PY] [--out DIR] [--cpu]
#                                [--dry-run] [--transitions N] [--image-records N]
#                                [--batch-size N] [--repeats N] [--target-s S]
#   --carry DIR   the wheels (default: .gpu-wheels/ beside benchmarks/)
#   --python PY   the machine's interpreter, the one with jax (default: python3)
#   --out DIR     results and the throwaway venv (default: bench_out/gpu)
#   --cpu         run the device section on CPU (JAX_PLATFORMS=cpu): the whole path
#                 without a GPU; the GPU targets are printed, not judged
#   --dry-run     say what would be installed and run; change nothing
# Exit status: 0 when the run went through (a missed target is a finding, printed);
# 2 bad usage or no wheels; 3 the install would touch or touched jax; 4 an import failed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
CARRY="$ROOT/.gpu-wheels"
PY=python3
OUT="$ROOT/bench_out/gpu"
CPU=0
DRY=0
TRANSITIONS=200000
IMAGES=20000
REPEATS=5
TARGET_S=""
BATCH=""

die() { echo "gpu_check: $2" >&2; exit "$1"; }
# What runs must be the carried wheels and the machine's packages, not a checkout on PYTHONPATH.
unset PYTHONPATH
while [ $# -gt 0 ]; do
  case "$1" in
    --carry) CARRY="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --transitions) TRANSITIONS="$2"; shift 2 ;;
    --image-records) IMAGES="$2"; shift 2 ;;
    --repeats) REPEATS="$2"; shift 2 ;;
    --target-s) TARGET_S="$2"; shift 2 ;;
    --batch-size) BATCH="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die 2 "unknown argument $1 (see --help)" ;;
  esac
done

command -v "$PY" >/dev/null 2>&1 || die 2 "no interpreter $PY. Fix: pass --python PATH (the one with jax)."
ls "$CARRY"/*.whl >/dev/null 2>&1 || die 2 "no wheels in $CARRY. Fix: run 'make gpu-wheels' on a machine with network, and carry $CARRY along."
CARRY="$(cd "$CARRY" && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

echo "==> the machine's interpreter: $PY"
JAX_BEFORE="$("$PY" -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__)')" \
  || die 4 "$PY cannot import jax: this script runs the device benchmarks on the machine's own jax."
echo "    python $("$PY" -c 'import platform; print(platform.python_version())'), jax and jaxlib $JAX_BEFORE"

# Which carried wheels to install: each one whose package the interpreter lacks, and
# grain_replay always (the code under test). A carried jax or jaxlib is refused.
PLAN="$("$PY" - "$CARRY" <<'PY'
import importlib.metadata as md
import os
import re
import sys

carry = sys.argv[1]
never = {"jax", "jaxlib"}
here = sys.version_info[:2]


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


for name in sorted(os.listdir(carry)):
    if not name.endswith(".whl"):
        continue
    dist, version = name.split("-")[:2]
    key = re.sub(r"[-_.]+", "-", dist).lower()
    try:
        have = md.version(key)
    except md.PackageNotFoundError:
        have = None
    if key == "grain-replay":
        print(f"install {name} grain_replay {version} (the code under test)")
    elif key in never:
        print(f"refuse {name} {key}: the machine's own {key} is never replaced")
    elif have is not None:
        print(f"keep {name} {key} {have} is installed (carried {version})")
    elif not for_this_python(name):
        print(f"skip {name} {key}: built for another Python than {here[0]}.{here[1]}")
    else:
        print(f"install {name} {key} {version}")
PY
)"
echo "==> carried wheels ($CARRY)"
echo "$PLAN" | sed 's/^/    /'
echo "$PLAN" | grep -q '^refuse ' && die 3 "the carry folder holds jax or jaxlib: those stay the machine's. Fix: rebuild it with 'make gpu-wheels'."
mapfile -t WHEELS < <(echo "$PLAN" | awk '$1 == "install" {print $2}')
echo "$PLAN" | grep -q '^install .*grain_replay' || die 2 "no grain_replay wheel in $CARRY. Fix: make gpu-wheels."

VENV="$OUT/venv"
RUN=(python benchmarks/run.py --sections device --transitions "$TRANSITIONS" --image-records "$IMAGES" --repeats "$REPEATS" --out "$OUT")
[ -n "$TARGET_S" ] && RUN+=(--target-s "$TARGET_S")
[ -n "$BATCH" ] && RUN+=(--batch-size "$BATCH")
if [ "$DRY" = 1 ]; then
  echo "==> dry run: would make $VENV (seeing every package of $PY), then"
  echo "    pip install --no-index --no-deps --force-reinstall ${WHEELS[*]}"
  echo "    check jax is still $JAX_BEFORE, import grain, zarr, grain_replay"
  echo "    $([ "$CPU" = 1 ] && echo 'JAX_PLATFORMS=cpu ')${RUN[*]}"
  exit 0
fi

echo "==> throwaway venv $VENV (sees every package of $PY; installs go only here)"
rm -rf "$VENV"
"$PY" -m venv --without-pip "$VENV"
VPY="$VENV/bin/python"
# The machine's packages after the venv's own (a .pth line appends to sys.path).
"$PY" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_machine.pth"
# pip from the machine's interpreter, pointed at the venv (the venv has no pip of its own);
# a pip older than 22.3 (no --python) installs into the venv's site-packages with --target.
PIP=("$PY" -m pip --disable-pip-version-check)
OPTS=(--quiet --no-index --no-deps --force-reinstall --find-links "$CARRY")
if "${PIP[@]}" --python "$VPY" --version >/dev/null 2>&1; then
  (cd "$CARRY" && "${PIP[@]}" --python "$VPY" install "${OPTS[@]}" "${WHEELS[@]}")
else
  PURELIB="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  (cd "$CARRY" && "${PIP[@]}" install "${OPTS[@]}" --target "$PURELIB" "${WHEELS[@]}")
fi || die 3 "pip could not install the carried wheels into $VENV."
JAX_AFTER="$("$VPY" -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__)')"
[ "$JAX_AFTER" = "$JAX_BEFORE" ] || die 3 "jax moved from $JAX_BEFORE to $JAX_AFTER: the install touched jax."
echo "==> jax unchanged: $JAX_AFTER"
cd "$OUT"  # not the checkout: `python -` puts the working directory on sys.path
"$VPY" - "$VENV" <<'PY' || die 4 "an import failed after the install (a dependency not carried?). Fix: rebuild the carry with 'make gpu-wheels' (GPU_WHEEL_PACKAGES names what it resolves)."
import sys
import grain, zarr, grain_replay
here = grain_replay.__file__
assert here.startswith(sys.argv[1]), f"grain_replay imported from {here}, not the carried wheel"
print(f"    grain {grain.__version__ if hasattr(grain, '__version__') else '?'}, zarr {zarr.__version__}, grain_replay {grain_replay.__version__} ({here})")
PY

echo "==> device section: ${RUN[*]}"
cd "$ROOT"
if [ "$CPU" = 1 ]; then export JAX_PLATFORMS=cpu; fi
"$VPY" "${RUN[@]:1}"

echo "==> GPU targets"
"$VPY" - "$OUT/results.json" <<'PY'
import json
import sys

doc = json.load(open(sys.argv[1]))
device = doc["sections"]["device"]
backend = device.get("jax", {}).get("backend", "?")
rows = device.get("gpu_targets", [])
if not rows:
    print("    none recorded (was the device section filtered out?)")
for r in rows:
    verdict = ("PASS" if r["passed"] else "FAIL") if r["judged"] else f"not judged ({backend})"
    print(f"    {verdict:<22} {r['name']}: {r['value']:.3g}x (target >= {r['target']:.3g})")
other = [r for r in device["ratios"] if r["target"] is not None]
for r in other:
    if all(r["name"] != g["name"] for g in rows):
        verdict = "PASS" if r["passed"] else "FAIL"
        print(f"    {verdict:<22} {r['name']}: {r['value']:.3g}x (target >= {r['target']:.3g})")
print(f"    backend {backend}; results in {sys.argv[1]}")
PY
