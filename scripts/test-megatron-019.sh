#!/usr/bin/env bash
# The megatron suite (tests/megatron) against megatron-core 0.19.2, the newest release, on CPU.
# 0.19 needs Python >= 3.12, so it gets its own virtual environment (CI keeps 0.16.1 on Python 3.11).
#   bash scripts/test-megatron-019.sh              -> .venv-mcore019 (created or reused), then the suite
#   bash scripts/test-megatron-019.sh -k hybrid    -> extra arguments go to pytest
# Environment:
#   RLK_VENV        the virtual environment (default .venv-mcore019)
#   RLK_PYTHON      the Python >= 3.12 that creates it (default: python3.12 on PATH)
#   RLK_TORCH       torch requirement (default torch==2.11.0, what the GPU machine runs; from PyPI that is
#                   a CUDA build, a few GB, and it runs on the CPU)
#   RLK_MEGATRON_WHEEL  a local megatron-core 0.19.2 wheel (default: megatron-core==0.19.2 from PyPI)
# Every rlk package is installed editable and pure Python (RLK_BUILD_EXT=0: no compiled ops).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RLK_VENV:-.venv-mcore019}"
want=0.19.2

if [ ! -x "$venv/bin/python" ]; then
  py="${RLK_PYTHON:-$(command -v python3.12 || true)}"
  [ -n "$py" ] && [ -x "$py" ] || { echo "test-megatron-019: set RLK_PYTHON to a Python >= 3.12" >&2; exit 2; }
  "$py" -c 'import sys; assert sys.version_info >= (3, 12), sys.version' \
    || { echo "test-megatron-019: $py is older than 3.12 (megatron-core $want needs >= 3.12)" >&2; exit 2; }
  echo "rlk: creating $venv with $py"
  "$py" -m venv "$venv"
fi
py="$venv/bin/python"
have=$("$py" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)
if [ "$have" != "$want" ] || ! "$py" -c "import rlk_megatron_provider, pytest" 2>/dev/null; then
  RLK_BUILD_EXT=0 RLK_VENV="$venv" RLK_TORCH="${RLK_TORCH:-torch==2.11.0}" RLK_FRAMEWORKS=skip \
    RLK_TRITON=skip bash scripts/dev-install.sh
  # --no-deps: megatron-core's base requirements (torch, numpy, packaging) come from dev-install; letting
  # pip resolve them could replace the torch chosen above.
  "$py" -m pip install --disable-pip-version-check -q --no-deps "${RLK_MEGATRON_WHEEL:-megatron-core==$want}"
  "$py" -m pip install --disable-pip-version-check -q numpy "packaging>=24.2"
fi
"$py" -W ignore -c "
import importlib.metadata as m
import megatron.core, megatron.core.models.gpt, megatron.core.models.hybrid.hybrid_model
v = m.version('megatron-core')
assert v == '$want', f'megatron-core {v} installed, wanted $want'
" || { echo "test-megatron-019: megatron-core $want does not import with $py" >&2; exit 1; }
exec "$py" -m pytest tests/megatron -q -p no:cacheprovider "$@"
