#!/usr/bin/env bash
# One-command dev install: a virtual environment with every rlk package editable plus test tools.
#   bash scripts/dev-install.sh            -> .venv (torch + all packages)
#   RLK_VENV=path bash scripts/dev-install.sh
# torch: on a CPU machine `pip install torch==2.13.0` takes the CPU build; set RLK_TORCH to override
# (e.g. RLK_TORCH=skip when the environment already has the torch you want).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RLK_VENV:-.venv}"
torch_req="${RLK_TORCH:-torch==2.13.0}"

if [ ! -x "$venv/bin/python" ]; then
  echo "rlk: creating $venv"
  python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade "pip>=24" "setuptools>=77" wheel
if [ "$torch_req" != "skip" ]; then
  "${pip[@]}" "$torch_req" numpy  # numpy with it: rlk-core's build imports torch, which warns without numpy
fi
# Triton: a CUDA torch brings its own; on a CPU machine it is installed for the kernels' interpreter tests
# (TRITON_INTERPRET=1). RLK_TRITON=skip leaves it out.
if [ "${RLK_TRITON:-triton==3.6.0}" != "skip" ] && ! "$venv/bin/python" -c "import triton" 2>/dev/null; then
  "${pip[@]}" "${RLK_TRITON:-triton==3.6.0}"
fi
# --no-build-isolation: rlk-core builds its compiled ops against the torch installed above.
"${pip[@]}" --no-build-isolation \
  -e "packages/rlk-core[test]" \
  -e packages/rlk-collectives \
  -e packages/rlk-vllm-plugin \
  -e packages/rlk-megatron-provider \
  -e "packages/rlk-validate[test,plot,sign]" \
  -e packages/rlk-repro \
  pytest ruff
# The real frameworks the adapters are tested against (CPU builds; the adapters' tests skip without them).
# RLK_FRAMEWORKS=skip leaves them out.
if [ "${RLK_FRAMEWORKS:-}" != "skip" ]; then
  bash scripts/install-megatron-cpu.sh "$venv/bin/python"
fi
echo "rlk: installed into $venv"
