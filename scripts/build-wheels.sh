#!/usr/bin/env bash
# Build every rlk package's wheel into one folder (default: dist/wheels).
#   bash scripts/build-wheels.sh [OUT_DIR]
# Then, in an environment that already has torch (and vLLM / megatron-core, for the adapters):
#   pip install --find-links OUT_DIR rlk-vllm-plugin        # or rlk-megatron-provider, rlk-repro, ...
# The wheels never ask for torch (a peer dependency), so that install leaves the environment's torch alone.
# rlk-core builds its compiled ops only where a CUDA toolchain and a CUDA torch are present (setup.py);
# RLK_BUILD_EXT=0 forces pure-Python wheels. PYTHON picks the interpreter (default: .venv's, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-dist/wheels}"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
mkdir -p "$out"
# --no-build-isolation: rlk-core's build looks at the installed torch and toolchain; the build needs
# setuptools >= 77 (SPDX license strings) and wheel in that interpreter.
"$python" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w "$out" \
  packages/rlk-validate packages/rlk-core packages/rlk-collectives packages/rlk-vllm-plugin \
  packages/rlk-megatron-provider packages/rlk-repro
ls -1 "$out"/rlk_*.whl
