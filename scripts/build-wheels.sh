#!/usr/bin/env bash
# Build every rlk package's wheel into one folder (default: dist/wheels), on any machine with Python >= 3.10
# and pip (no virtual environment of this repository needed).
#   bash scripts/build-wheels.sh [OUT_DIR]
# Then, in an environment that already has torch (and vLLM / megatron-core, for the adapters):
#   pip install --find-links OUT_DIR rlk-vllm-plugin        # or rlk-megatron-provider, rlk-repro, ...
# The wheels never ask for torch (a peer dependency), so that install leaves the environment's torch alone.
#
# Each package is built in pip's isolated build environment with the build backend it declares
# (pyproject.toml [build-system]: setuptools>=77), so the interpreter's own setuptools does not matter. The one
# exception is rlk-core WITH its compiled ops (rlk.cuda: rlk_core._C + the AOT cubins): they are compiled against
# the interpreter's own CUDA torch, so that build runs without isolation and needs setuptools>=77 and wheel
# there. rlk-core gets its compiled ops where the interpreter has a CUDA torch and a CUDA toolchain (nvcc or
# CUDA_HOME); RLK_BUILD_EXT=0 forces the pure-Python wheel, RLK_BUILD_EXT=1 fails unless the compiled ops build.
# A pure-Python rlk-core wheel says so at the end: it lacks rlk.cuda (`rlk-repro doctor` says so too).
# PYTHON picks the interpreter (default: .venv's, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  -*) echo "build-wheels: unknown option $1 (see --help)" >&2; exit 2 ;;
esac
out="${1:-dist/wheels}"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
want="${RLK_BUILD_EXT:-auto}"
case "$want" in auto|0|1) ;; *) echo "build-wheels: RLK_BUILD_EXT=$want is not auto, 0 or 1" >&2; exit 2 ;; esac
mkdir -p "$out"
log="$(mktemp -t rlk-build-wheels.XXXXXX.log)"
trap 'rm -f "$log"' EXIT
wheel=("$python" -m pip wheel --disable-pip-version-check -q --no-deps -w "$out")
build() {  # build PACKAGE_DIR [pip options...]; pip's output only when it fails
  local pkg="$1"; shift
  echo "rlk: building $(basename "$pkg")"
  if ! "${wheel[@]}" "$@" "$pkg" >"$log" 2>&1; then
    tail -n 40 "$log" >&2; echo "build-wheels: building $pkg failed (pip's output above)" >&2; exit 1
  fi
}

# Why rlk-core would be pure Python here (the same decision as packages/rlk-core/setup.py), or nothing.
why_pure() {
  [ "$want" = 0 ] && { echo "RLK_BUILD_EXT=0"; return; }
  "$python" -c "import torch" 2>/dev/null || { echo "$python has no torch"; return; }
  "$python" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" \
    || { echo "$python's torch is a CPU build"; return; }
  command -v nvcc >/dev/null 2>&1 || [ -n "${CUDA_HOME:-}" ] || { echo "no CUDA toolchain (nvcc) found"; return; }
  return 0
}
pure="$(why_pure)"
if [ -n "$pure" ] && [ "$want" = 1 ]; then
  echo "build-wheels: RLK_BUILD_EXT=1 but rlk-core's compiled ops cannot be built: $pure" >&2; exit 1
fi

for pkg in rlk-validate rlk-collectives rlk-vllm-plugin rlk-megatron-provider rlk-repro; do
  build "packages/$pkg"
done
if [ -n "$pure" ]; then
  RLK_BUILD_EXT=0 build packages/rlk-core
else
  if ! "$python" -c "
import sys
from importlib.metadata import version
major = int(version('setuptools').split('.')[0])
version('wheel')
sys.exit(0 if major >= 77 else 1)" 2>/dev/null; then
    echo "build-wheels: rlk-core's compiled ops build against $python's own torch (no build isolation) and" \
      "need setuptools>=77 and wheel there: $python -m pip install 'setuptools>=77' wheel" >&2
    exit 1
  fi
  echo "rlk: rlk-core with its compiled ops (rlk.cuda), against $python's torch: this takes a while"
  build packages/rlk-core --no-build-isolation
fi

core="$(ls -t "$out"/rlk_core-*.whl | head -n 1)"
if "$python" -c "import sys, zipfile; sys.exit(0 if any(n.startswith('rlk_core/_C') for n in zipfile.ZipFile(sys.argv[1]).namelist()) else 1)" "$core"; then
  echo "rlk: $(basename "$core"): with rlk.cuda (rlk_core._C and the AOT cubins)"
else
  echo "rlk: $(basename "$core"): pure Python, WITHOUT rlk.cuda (${pure:-the compiled ops did not build});" \
    "on a GPU its ops run the rlk.triton JIT kernels (the same bits, compiled on first use)"
fi
ls -1 "$out"/rlk_*.whl
