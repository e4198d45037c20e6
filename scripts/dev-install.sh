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
# On a terminal pip shows what it collects and downloads (with its progress bars); into a log it stays quiet.
# Every step says first what it installs and roughly what it downloads.
if [ -t 1 ]; then quiet=(); else quiet=(-q); fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check "${quiet[@]}")
step() { echo "rlk: $*"; }
step "upgrading pip, setuptools>=77 and wheel in $venv (a few MB)"
"${pip[@]}" --upgrade "pip>=24" "setuptools>=77" wheel
if [ "$torch_req" != "skip" ]; then
  step "installing $torch_req and numpy: the largest download (~200 MB for a CPU build; a CUDA build brings" \
    "its CUDA libraries, a few GB; pip's cache is reused)"
  "${pip[@]}" "$torch_req" numpy  # numpy with it: rlk-core's build imports torch, which warns without numpy
fi
# Triton: a CUDA torch brings its own; on a CPU machine it is installed for the kernels' interpreter tests
# (TRITON_INTERPRET=1). RLK_TRITON=skip leaves it out.
if [ "${RLK_TRITON:-triton==3.6.0}" != "skip" ] && ! "$venv/bin/python" -c "import triton" 2>/dev/null; then
  step "installing ${RLK_TRITON:-triton==3.6.0} for the kernels' interpreter tests (~150 MB)"
  "${pip[@]}" "${RLK_TRITON:-triton==3.6.0}"
fi
# --no-build-isolation: rlk-core builds its compiled ops against the torch installed above.
step "installing the six rlk packages (editable) with their small dependencies (rlk-repro's prepare and tokenizer" \
  "extras: pyarrow and tokenizers, ~45 MB), pytest and ruff"
"${pip[@]}" --no-build-isolation \
  -e "packages/rlk-core[test]" \
  -e packages/rlk-collectives \
  -e packages/rlk-vllm-plugin \
  -e packages/rlk-megatron-provider \
  -e "packages/rlk-validate[test,plot,sign]" \
  -e "packages/rlk-repro[prepare,tokenizer]" \
  pytest ruff
# The real frameworks the adapters are tested against (CPU builds; the adapters' tests skip without them).
# RLK_FRAMEWORKS=skip leaves them out.
if [ "${RLK_FRAMEWORKS:-}" != "skip" ]; then
  step "installing megatron-core (CPU) for the adapter tests (RLK_FRAMEWORKS=skip leaves it out)"
  bash scripts/install-megatron-cpu.sh "$venv/bin/python"
fi
echo "rlk: installed into $venv"
