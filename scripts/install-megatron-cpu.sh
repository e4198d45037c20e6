#!/usr/bin/env bash
# Install real megatron-core 0.16.1 (the API slime/VIME pin) into a CPU Python environment, for the
# `megatron` test marker. No TransformerEngine, no apex: the CPU tests use Megatron's local spec.
#   bash scripts/install-megatron-cpu.sh .venv/bin/python
# Idempotent (does nothing when 0.16.1 is already importable); quiet; exits non-zero on any failure.
# --no-deps: megatron-core's base dependencies (torch, numpy, packaging) are already in an rlk env;
# letting pip resolve them could replace the CPU torch.
set -euo pipefail
py="${1:?usage: install-megatron-cpu.sh VENV_PYTHON}"
version="${RLK_MEGATRON_CORE:-0.16.1}"
[ -x "$py" ] || { echo "install-megatron-cpu: $py is not an executable Python" >&2; exit 2; }
have=$("$py" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)
if [ "$have" != "$version" ]; then
  "$py" -m pip install --disable-pip-version-check -q --no-deps "megatron-core==$version"
  "$py" -m pip install --disable-pip-version-check -q "numpy" "packaging>=24.2"
fi
# Fail loudly if it does not import (TE/apex absence only warns).
"$py" -W ignore -c "
import importlib.metadata as m, torch
import megatron.core, megatron.core.models.gpt
v = m.version('megatron-core')
assert v == '$version', f'megatron-core {v} installed, wanted $version'
" || { echo "install-megatron-cpu: megatron-core $version does not import with $py" >&2; exit 1; }
