#!/usr/bin/env bash
# Install the wheels as a user would, into a fresh virtual environment that already holds a CPU torch,
# and check that the environment's torch is left exactly as it was.
#   bash scripts/check-wheel-install.sh WHEEL_DIR [PACKAGE ...]    (default packages: both adapters)
# Exit status non-zero on any failure. RLK_TORCH picks the torch to preinstall (default torch==2.13.0).
set -euo pipefail
wheels="$(cd "$1" && pwd)"; shift
packages=("$@")
[ ${#packages[@]} -gt 0 ] || packages=(rlk-vllm-plugin rlk-megatron-provider)
declare -A module=([rlk-vllm-plugin]=rlk_vllm_plugin [rlk-megatron-provider]=rlk_megatron_provider
                   [rlk-core]=rlk_core [rlk-collectives]=rlk_collectives [rlk-validate]=rlk_validate
                   [rlk-repro]=rlk_repro)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)
"${pip[@]}" "${RLK_TORCH:-torch==2.13.0}" numpy
torch_before="$("$py" -m pip show torch | grep -E '^(Version|Location):' | tr '\n' ' ')"
for pkg in "${packages[@]}"; do
  echo "rlk: pip install --find-links $wheels $pkg"
  log="$work/install-$pkg.log"
  if ! "$py" -m pip install --disable-pip-version-check --find-links "$wheels" "$pkg" >"$log" 2>&1; then
    cat "$log" >&2; echo "rlk: installing $pkg failed" >&2; exit 1
  fi
  if grep -iE 'warning|deprecat' "$log" | grep -viE 'pip version|location .* is ignored' >&2; then
    echo "rlk: installing $pkg printed warnings (above)" >&2; exit 1
  fi
  torch_after="$("$py" -m pip show torch | grep -E '^(Version|Location):' | tr '\n' ' ')"
  if [ "$torch_before" != "$torch_after" ]; then
    echo "rlk: installing $pkg changed torch: $torch_before -> $torch_after" >&2; exit 1
  fi
  out="$("$py" -c "import ${module[$pkg]}" 2>&1)" || { echo "$out" >&2; echo "rlk: import ${module[$pkg]} failed" >&2; exit 1; }
  if [ -n "$out" ]; then echo "$out" >&2; echo "rlk: import ${module[$pkg]} printed output" >&2; exit 1; fi
  echo "rlk: $pkg installed; torch unchanged ($torch_after); import ${module[$pkg]} is silent"
done
out="$("$py" -W error -c "import rlk_core.ops" 2>&1)" || { echo "$out" >&2; echo "rlk: import rlk_core.ops failed" >&2; exit 1; }
if [ -n "$out" ]; then echo "$out" >&2; echo "rlk: import rlk_core.ops printed output" >&2; exit 1; fi
echo "rlk: import rlk_core.ops (torch, the op registry) is silent"
"$py" -m pip list --disable-pip-version-check --format=freeze | grep -E '^rlk-' | sort
