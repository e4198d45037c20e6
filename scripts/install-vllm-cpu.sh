#!/usr/bin/env bash
# Real vLLM for the CPU suite tests/vllm, installed next to the venv's own CPU torch (never replacing it).
#   bash scripts/install-vllm-cpu.sh VENV_PYTHON          e.g. .venv/bin/python
#   RLK_VLLM_VERSION=0.22.0 (default; the VIME pin)
# The recipe of shared/reference/vllm.md §12.1: the vLLM wheel with --no-deps (its own pins would pull a CUDA
# torch 2.11 and ~3 GB of CUDA wheels), then the pure-Python dependencies that the imports the plugin and its
# tests use ask for, under a constraint that holds torch and numpy at the versions the venv already has.
# Then the test-only platform plugin (tests/vllm/cpu_platform: vllm.platform_plugins -> a CpuPlatform when
# RLK_TEST_VLLM_CPU_PLATFORM=1; vLLM 0.33 takes VLLM_TARGET_DEVICE=cpu as its own CPU platform and never asks
# platform plugins), which never ships in a production wheel.
# Idempotent: a second run that finds everything in place does nothing. Quiet: pip's output goes to a log
# that is printed only when a step fails. Exits non-zero, naming the step, on any failure — including a
# torch that changed under it.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:?usage: install-vllm-cpu.sh VENV_PYTHON}"
version="${RLK_VLLM_VERSION:-0.22.0}"
log="$(mktemp -t rlk-vllm-install.XXXXXX.log)"
trap 'rm -f "$log" "${constraints:-}"' EXIT
fail() { echo "install-vllm-cpu: $*" >&2; [ -s "$log" ] && tail -n 60 "$log" >&2; exit 1; }

"$py" -c "import torch" 2>/dev/null || fail "$py has no torch; install the venv first (scripts/dev-install.sh)"
torch_before="$("$py" -c 'import torch; print(torch.__version__)')"
numpy_before="$("$py" -c 'import numpy; print(numpy.__version__)' 2>/dev/null || true)"

# Pure-Python dependencies of the vLLM modules the plugin and tests import (config, layers, models/qwen3,
# attention registry, distributed, v1 sampler). Versions inside vLLM 0.22.0's own Requires-Dist ranges.
deps=(
  "transformers==5.17.*" "tokenizers>=0.21.1" "safetensors>=0.6.2" uvloop
  "pydantic>=2.12" msgspec "pyzmq>=25" cloudpickle "typing_extensions>=4.10" "filelock>=3.16.1" pyyaml einops
  cbor2 pybase64 setproctitle "prometheus_client>=0.18" sentencepiece regex cachetools psutil "requests>=2.26"
  tqdm blake3 py-cpuinfo packaging "protobuf>=5.29.6,<6.30" "aiohttp>=3.13.3" "openai>=2.0" pillow
  "fastapi>=0.115" partial-json-parser "gguf>=0.17" "depyf==0.20.0" ijson
  watchfiles python-json-logger diskcache==5.6.3 lark==1.2.2 "openai-harmony>=0.0.3"
)
# The pins that differ between the versions the plugin supports (each from that wheel's Requires-Dist).
case "$version" in
  0.22.*) deps+=("compressed-tensors==0.15.0.1") ;;
  0.33.*) deps+=("compressed-tensors==0.17.0" "tokenizers>=0.23.2" "aiohttp>=3.14.4" "openai>=2.25.0"
                 "huggingface_hub>=1.31.0" "starlette>=1.0.1" orjson "oss-harmony>=0.0.11" "xgrammar==0.2.8"
                 "llguidance>=1.7.0,<1.8.0" "outlines_core==0.2.14" "lm-format-enforcer==0.11.3" tiktoken
                 "jsonschema>=4.23.0") ;;
  *) fail "no dependency pins for vLLM $version (known: 0.22.*, 0.33.*)" ;;
esac

ready() {  # vLLM of the wanted version imports and the test platform plugin is registered
  "$py" - "$version" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("vllm") == sys.argv[1]
assert any(e.name == "rlk_test_cpu" for e in md.entry_points(group="vllm.platform_plugins"))
import vllm  # noqa: F401
from vllm.model_executor.models import qwen3  # noqa: F401
from vllm.v1.attention.backends import registry  # noqa: F401
PY
}

if ready; then
  exit 0
fi
start=$SECONDS
pip=("$py" -m pip install --disable-pip-version-check -q)
constraints="$(mktemp -t rlk-vllm-constraints.XXXXXX.txt)"
echo "torch==${torch_before%%+*}" > "$constraints"  # without a local label (+cu130), which pip cannot match
[ -n "$numpy_before" ] && echo "numpy==$numpy_before" >> "$constraints"

"${pip[@]}" --no-deps "vllm==$version" >>"$log" 2>&1 || fail "pip install --no-deps vllm==$version failed"
"${pip[@]}" -c "$constraints" "${deps[@]}" >>"$log" 2>&1 || fail "installing vLLM's pure-Python dependencies failed"
"${pip[@]}" --no-deps --no-build-isolation -e tests/vllm/cpu_platform >>"$log" 2>&1 \
  || fail "installing the test-only platform plugin (tests/vllm/cpu_platform) failed"

torch_after="$("$py" -c 'import torch; print(torch.__version__)')"
[ "$torch_after" = "$torch_before" ] || fail "torch changed from $torch_before to $torch_after"
env -u VLLM_TARGET_DEVICE RLK_TEST_VLLM_CPU_PLATFORM=1 "$py" - >>"$log" 2>&1 <<'PY' \
  || fail "vLLM $version does not import next to torch $torch_before, or the test CPU platform is not selected"
import vllm
from vllm.model_executor.models import qwen3  # noqa: F401
from vllm.platforms import current_platform
assert current_platform.is_cpu() and type(current_platform).__name__ == "TestCpuPlatform", current_platform
PY
ready || fail "vLLM $version installed but the readiness check fails"
echo "install-vllm-cpu: vLLM $version on torch $torch_before in $((SECONDS - start)) s"
