#!/usr/bin/env bash
# One device call: GPU tests, compute-sanitizer on every kernel, benchmarks. Results under $OUT
# (log + one tarball, to stay within the few files a call brings back). Usage, from the repo root:
#   RLK_COMMIT=<sha> STAGES="tests sanitize bench engine" BENCHES="attention logprobs" bash benchmarks/run_device.sh
# TESTS (default tests/gpu) and TEST_TIMEOUT (420 s) narrow the pytest stage; SANITIZE_TOOLS
# (memcheck racecheck), SANITIZE_PARTS (see tests/gpu/sanitize_kernels.py) and SANITIZE_TIMEOUT the
# sanitizer stage; SWEEP_ARGS the sweep stage (benchmarks/sweep_kernels.py); stage "host" runs
# benchmarks/host_overhead.py --breakdown.
set -u
OUT=${OUT:-/tmp/rlk-out}
mkdir -p "$OUT/res"
export PYTHONPATH=$PWD/packages/rlk-core/src:$PWD/packages/rlk-repro/src:$PWD/packages/rlk-validate/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
export RLK_BENCH_OUT=$OUT/res RLK_REQUIRE_GPU=1
STAGES=${STAGES:-"tests sanitize bench"}
BENCHES=${BENCHES:-"linear rms_norm swiglu rope attention logprobs"}
TESTS=${TESTS:-tests/gpu}
log() { echo "=== $* ($(date +%T))"; }
{
log env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
for s in $STAGES; do case $s in
tests)
  log pytest; timeout ${TEST_TIMEOUT:-420} python3 -m pytest $TESTS -q -p no:cacheprovider --durations=15 \
    --junitxml="$OUT/res/pytest.xml" 2>&1 | tail -120 ;;
sanitize)
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    log "compute-sanitizer $tool"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 3 \
      python3 tests/gpu/sanitize_kernels.py ${SANITIZE_PARTS:-} > "$OUT/res/sanitize_$tool.txt" 2>&1
    echo "exit $?"; tail -5 "$OUT/res/sanitize_$tool.txt"
  done ;;
sweep)
  log sweep; RLK_BENCH_OUT=$OUT/res/sweep timeout ${SWEEP_TIMEOUT:-420} python3 benchmarks/sweep_kernels.py ${SWEEP_ARGS:-} 2>&1 | tail -150 ;;
bench)
  for b in $BENCHES; do log bench $b; timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_$b.py ${BENCH_ARGS:-} 2>&1 | grep -v '^$' | tail -400; done ;;
host)
  log host overhead; timeout ${HOST_TIMEOUT:-240} python3 benchmarks/host_overhead.py --breakdown 2>&1 | tail -60 ;;
engine)
  log local engine; timeout ${ENGINE_TIMEOUT:-540} python3 benchmarks/bench_local_engine.py ${ENGINE_ARGS:-} 2>&1 | grep -v 'it/s\]$' | tail -150 ;;
esac; done
log done
} 2>&1 | tee "$OUT/log.txt"
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$OUT/res"
