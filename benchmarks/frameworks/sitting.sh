#!/bin/bash
# One GPU sitting with real vLLM + megatron-core: prepare on the CPU machine, move in N device calls, run stages.
#
#   bash benchmarks/frameworks/sitting.sh prepare     # CPU machine: prints N and the calls to make
#   MOE=1 bash benchmarks/frameworks/sitting.sh prepare   # the same with vLLM's MoE kernels (for stage moe-loop)
#   calls 1..N-1, carry [".xfer/callK"]:  bash benchmarks/frameworks/sitting.sh recv K
#   call N, carry [".xfer/callN"]:        bash benchmarks/frameworks/sitting.sh recv-last N STAGE[:SECONDS] ...
#   later calls (warm machine):           bash benchmarks/frameworks/sitting.sh run STAGE[:SECONDS] ...
#
# Light sitting (no vLLM: megatron-core 0.19.2 + a `git archive` of HEAD in ONE call; stages cuda, megatron,
# hybrid, local):
#   bash benchmarks/frameworks/sitting.sh prepare-lite       # CPU machine
#   carry [".xfer/lite"]:  bash benchmarks/frameworks/sitting.sh recv-lite STAGE[:SECONDS] ...
#
# What moves: vLLM's stripped site (shared/tools/frameworks-on-h200/make-site.sh), megatron-core 0.19.2 and a
# `git archive` of HEAD (so rlk_repro/REVISION names the exact commit in every manifest), as one bundle cut to fit
# each call under the device's 64 MiB with the tracked tree. Files survive on the GPU machine only while it is warm
# (30 s after a call): make the calls back to back. Each stage writes under /tmp/sit/<stage> and leaves ONE file,
# $OUT/<stage>.tar.gz (the device returns a limited number of files, only shallow ones); a stage is killed at its
# time cap (defaults below), so a sitting cannot overrun its call; the device budget is 30 min a session.
#
# Stages: vllm-filtered (vllm_gpu.py with top-p 0.95 / top-k 40: R/R vs native, profiles), exact-megatron / exact-vllm / exact-loop (tests/frameworks/test_<name>_exact.py under RLK_REQUIRE_GPU=1: the
# bitwise tests of the adapters in the real frameworks and of the frameworks loop; $EXACT_MARK, default
# "gpu and not multi_gpu"; the loop's R/R run directory is kept as rr-run/), exact (every one of them; $EXACT_MARK
# "multi_gpu" on an x2 machine), vllm (vllm_gpu.py: throughput), vllm-capture (R/R and P/P with --capture-max 4096),
# loop (loop_gpu.py: R/R 10 rounds + P/P, throughput), moe-loop (moe_loop_gpu.py: Qwen3-MoE R/R 5 rounds + P/P 3,
# rlk-validate on both, routing and K3 KL; needs `MOE=1 ... prepare`: the site with vLLM's MoE kernels), tp-emu-loop
# (tp_emu_loop_gpu.py, issue 35: R/R with vLLM TP 1 and Megatron at emulated TP 4 with SP, invariant mode, 6 rounds of
# 64 prompts x 8 samples, weights synced every round, >= 100,000 compared tokens, rlk-validate --require-bitwise; then
# 1 round of the bi-control negative control, which must mismatch; $TP_EMU_ROUNDS), filtered
# (filtered_gpu.py: top-k / top-p / min-p runs), processed (bench_processed_logprobs.py), linear-tp (bench_linear_tp.py:
# the cost of rlk.gemm.tp.v1 per rank; $LINEAR_TP_ARGS, e.g. --quick), vllm-mp (vllm_gpu.py R/R with
# VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core's readbacks), matrix-a / matrix-b (loop_gpu.py --matrix, 4 cells each, 2
# rounds), hybrid (megatron_gpu.py --hybrid), megatron (megatron_gpu.py: step time), cuda (build rlk_core._C + cubins, the rlk.cuda and
# log-prob GPU tests — or the files in $CUDA_TESTS, selected by $CUDA_TESTS_K and marker $CUDA_MARK (default "gpu and
# not multi_gpu") —, host_overhead.py $HOST_SECTIONS within $HOST_CAP s, default 90, 0: none), tests ($GPU_TESTS, default tests/gpu, no
# build), local (bench_local_engine.py: the local
# engine R/R and P/P, 8 rounds, per-round throughput), profile (profile_rollout.py: a rollout step's host time by
# callee, R/R or $PROFILE_MODE, 2 rounds).
# Stage ladder (issue 38): ladder_gpu.py — the FP8 re-quantization vs vLLM's kernel, then `rlk-repro ladder --engine
# frameworks` (six rungs, FP8 included; $LADDER_RUNGS: others, "all": eight) on the Qwen3-0.6B shape, rlk-validate ladder.
# Stage attribute (issue 38): attribute_gpu.py — `rlk-repro attribute` on the ladder's FP8, top-p, near-aligned and R/R
# rungs (run `ladder` first in the same sitting, or it runs a one-round ladder of those rungs itself).
# Stages learn-a / learn-b / learn (issue 37, "a model that learns"): learn_gpu.py — the synthetic math set, a ~190M
# Qwen3-shaped model warm-started on it, GRPO (deepscaler reward) through the frameworks engine, the convergence phase
# shortened to 100 rounds, native and consistency on seed 1234, rlk-validate, rlk-repro report. learn-a: data, tokenizer,
# checkpoint, warm start and the native run; learn-b (the next call, machine still warm: /tmp/learn is kept): the
# consistency run, validation, report; learn: all in one call. $LEARN_ARGS: learn_gpu.py options (e.g. --lr 1e-5).
# Stages tp-cost-vllm / tp-cost-vllm-8b / tp-cost-megatron (issue 35: TP-invariant mode's end-to-end cost, target <= 10%):
# vllm_gpu.py --tp-invariant ${TP_COST_G:-8} --skip pp,bi — R/R off (rr) against R/R with RL_KERNEL_TP_INVARIANT (rr_tp),
# TP 1, the Qwen3-0.6B shape (-8b: qwen3-8b-L8, Qwen3-8B's layer shape with 8 layers); megatron_gpu.py --tp-cost
# ${TP_COST_G:-8}: the rlk training step built without and with the variable, Qwen3-0.6B then qwen3-8b-L4 if the cap
# allows. Run after cuda (rlk.cuda's cubins) or rlk.triton's JIT serves; the JSON's tp_cost holds the ratios.
# Stage moe-bench (issue 36's performance part; needs `MOE=1 ... prepare`: the site's vllm/_moe_C for vLLM's fused MoE):
# bench_moe.py — the Qwen3-30B-A3B MoE layer as the vLLM plugin's R method runs it vs vLLM's fused MoE, decode 1..256
# and prefill 2k..16k tokens, target ratio >= 0.8 ($MOE_BENCH_ARGS: its options, e.g. --quick or --backward) — then
# megatron_moe_gpu.py: the Megatron training step of $MOE_MODEL (default qwen3-moe-30b-a3b-L2) with rlk's MoE layer vs
# the stock MoELayer (SequentialMLP; GroupedMLP where it builds without TE), target >= 1.0. Run after cuda or
# rlk.triton's JIT serves. Results: moe.json/.md, megatron_moe_gpu.json/.md.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SHIP=/tmp/ship
declare -A CAP=([vllm]=420 [vllm-filtered]=420 [vllm-capture]=300 [loop]=420 [moe-loop]=560 [matrix-a]=400 [matrix-b]=400 [hybrid]=180
                [megatron]=240 [cuda]=330 [local]=420 [tests]=300 [profile]=200 [exact]=560 [exact-megatron]=240
                [exact-vllm]=480 [exact-loop]=420 [filtered]=560 [processed]=240 [linear-tp]=150 [vllm-mp]=200
                [tp-emu-loop]=470)

prepare() {
    cd "$ROOT" || exit 2
    for d in /.xfer/ /.gpu-src/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
    # make-site.sh's output, kept once under .xfer/src; MOE=1: the site with vLLM's MoE kernels (make-site.sh's three
    # parts: OUT/3 holds every part after the second), kept apart under .xfer/src-moe (built in .xfer/moe)
    local src=.xfer/src site=.xfer
    [ "${MOE:-0}" = 1 ] && { src=.xfer/src-moe; site=.xfer/moe; }
    if [ ! -d "$src" ]; then
        [ -f "$site/1/vllm_site.tar.xz.part_00" ] || MOE=${MOE:-0} bash ../shared/tools/frameworks-on-h200/make-site.sh \
            "$site" || exit 3
        if [ "${MOE:-0}" = 1 ] && ! ls "$site"/3/vllm_site.tar.xz.part_* >/dev/null 2>&1; then
            echo "MOE=1: $site/3 has no site part (make-site.sh MOE=1 makes three parts)"; exit 3
        fi
        mkdir -p "$src" && mv "$site"/1/vllm_site.tar.xz.part_* "$site"/2/vllm_site.tar.xz.part_* "$site"/2/*.sha256 \
            "$site"/2/megatron_core-0.19.2-*.whl "$src/" || exit 3
        if [ -d "$site/3" ]; then mv "$site"/3/vllm_site.tar.xz.part_* "$src/" || exit 3; fi
    fi
    local b=/tmp/rlk-bundle
    rm -rf "$b" "$b".part_* .xfer/call* && mkdir -p "$b" || exit 4
    # every site part in order (part_00, part_01 and, MOE=1, part_02...): the sha256 below checks the whole
    cat "$src"/vllm_site.tar.xz.part_* > "$b/vllm_site.tar.xz" && cp "$src"/*.sha256 "$src"/megatron_core-0.19.2-*.whl "$b/"
    (cd "$b" && sha256sum -c vllm_site.tar.xz.sha256 >/dev/null) || exit 4
    # vLLM's FP8 quantization (--rollout-quantization fp8: stage ladder) imports compressed-tensors and, on CUDA,
    # humming (vllm/model_executor/layers/quantization/humming.py at import; it imports elftools), which the stripped site lacks: their
    # pure-Python wheels (vLLM 0.22's pins) and loguru's, downloaded once
    if ! ls .xfer/fp8-deps/pyelftools-*.whl >/dev/null 2>&1; then
        python3 -m pip download -q --no-deps -d .xfer/fp8-deps compressed-tensors==0.15.0.1 loguru==0.7.3 \
            humming-kernels==0.1.2 pyelftools==0.32 >/dev/null 2>&1 || echo "no FP8 dependency wheels (no index?): FP8 rungs will fail"
    fi
    mkdir -p "$b/fp8-deps" && cp .xfer/fp8-deps/*.whl "$b/fp8-deps/" 2>/dev/null
    ship_archive "$b/ship.tar.xz" || exit 4
    local tree shared cap n=0
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    shared=$(du -sbL ../shared 2>/dev/null | cut -f1)
    cap=$(( 64 * 1048576 - tree - ${shared:-0} - 2 * 1048576 ))  # what one call can carry beside the tree
    tar -cf - -C "$b" . | split -b "$cap" -d -a 1 - "$b.part_" || exit 4
    for part in "$b".part_*; do
        n=$((n + 1)); mkdir -p ".xfer/call$n" && mv "$part" ".xfer/call$n/bundle.part_$((n - 1))"
    done
    rm -rf "$b"
    echo "$n calls (each <= $(( cap / 1048576 )) MiB + the $(( tree / 1048576 )) MiB tree), code $(git rev-parse --short HEAD):"
    for k in $(seq 1 $((n - 1))); do echo "  carry [\".xfer/call$k\"]: bash benchmarks/frameworks/sitting.sh recv $k"; done
    echo "  carry [\".xfer/call$n\"]: bash benchmarks/frameworks/sitting.sh recv-last $n STAGE[:SECONDS] ..."
}

ship_archive() {  # ship_archive OUT.tar.xz: the code of $RLK_SHIP_REV (default HEAD) as stages run it (REVISION filled
    local paths rev=${RLK_SHIP_REV:-HEAD}  # by export-subst)
    paths=$(git ls-tree -r --name-only "$rev" benchmarks | grep -v '^benchmarks/results/')
    # shellcheck disable=SC2086
    git archive --format=tar --prefix=.gpu-src/ "$rev" packages csrc tests/gpu tests/megatron tests/frameworks \
        tests/core/_cuda_cases.py tests/conftest.py pyproject.toml $paths \
        | xz -6 > "$1"
}

prepare_lite() {
    cd "$ROOT" || exit 2
    grep -qxF /.xfer/ .git/info/exclude || echo /.xfer/ >> .git/info/exclude
    local whl
    whl=$(ls .xfer/src/megatron_core-0.19.2-*.whl .xfer/src-moe/megatron_core-0.19.2-*.whl .xfer/2/megatron_core-0.19.2-*.whl \
        2>/dev/null | head -1)  # kept by prepare, MOE=1 prepare or make-site.sh
    [ -n "$whl" ] || { echo "no megatron-core 0.19.2 wheel: run prepare (or make-site.sh) first"; exit 3; }
    rm -rf .xfer/lite && mkdir -p .xfer/lite && cp "$whl" .xfer/lite/ || exit 4
    ship_archive .xfer/lite/ship.tar.xz || exit 4
    echo "1 call, code $(git rev-parse --short "${RLK_SHIP_REV:-HEAD}"), $(du -sh .xfer/lite | cut -f1):"
    echo "  carry [\".xfer/lite\"]: bash benchmarks/frameworks/sitting.sh recv-lite STAGE[:SECONDS] ..."
}

recv_lite() {
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .xfer/lite/megatron_core-0.19.2-*.whl \
        || exit 5
    mkdir -p "$SHIP" && tar -xJf .xfer/lite/ship.tar.xz -C "$SHIP" || exit 6
    echo "megatron-core and code ($(cat "$SHIP/.gpu-src/packages/rlk-repro/src/rlk_repro/REVISION")) in place"
}

recv() { mkdir -p /tmp/xfer && cp ".xfer/call$1/"* /tmp/xfer/ && echo "part $1 received"; }

recv_last() {
    recv "$1" || exit 3
    (cd /tmp/xfer && cat bundle.part_* | tar -x && sha256sum -c vllm_site.tar.xz.sha256) || exit 3
    python3 -c "import tarfile; tarfile.open('/tmp/xfer/vllm_site.tar.xz').extractall('/tmp/site')" || exit 4
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore /tmp/xfer/megatron_core-0.19.2-*.whl \
        || exit 5
    if ls /tmp/xfer/fp8-deps/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/xfer/fp8-deps/*.whl || exit 5
    fi
    mkdir -p "$SHIP" && tar -xJf /tmp/xfer/ship.tar.xz -C "$SHIP" || exit 6
    local moe="without vLLM's MoE kernels"
    [ -f /tmp/site/vllm/_moe_C.abi3.so ] && moe="with vLLM's MoE kernels (_moe_C)"
    echo "site ($moe), megatron-core and code ($(cat "$SHIP/.gpu-src/packages/rlk-repro/src/rlk_repro/REVISION")) in place"
}

stage() {  # stage NAME SECONDS
    local name=$1 cap=$2 G="$SHIP/.gpu-src" out="/tmp/sit/$1"
    local py="python3"
    mkdir -p "$out"
    export PYTHONPATH=/tmp/site:/tmp/mcore:$G/packages/rlk-core/src:$G/packages/rlk-validate/src:$G/packages/rlk-collectives/src:$G/packages/rlk-vllm-plugin/src:$G/packages/rlk-megatron-provider/src:$G/packages/rlk-repro/src
    export RLK_COMMIT
    RLK_COMMIT=$(cat "$G/packages/rlk-repro/src/rlk_repro/REVISION")
    echo "=== $name (cap ${cap}s) $(date +%T)"
    nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader > "$out/gpu-before.txt" 2>&1
    case $name in
        vllm) timeout "$cap" $py "$G/benchmarks/frameworks/vllm_gpu.py" --budget-s $((cap - 15)) --out "$out" ;;
        vllm-filtered)  # vllm_gpu.py R/R vs native with the seeds' filters (top-p 0.95, top-k 40), profiles of both
            timeout "$cap" $py "$G/benchmarks/frameworks/vllm_gpu.py" --top-p 0.95 --top-k 40 --skip bi --profile \
                --gen-budget-s 40 --gen-repeats 3 --budget-s $((cap - 15)) --out "$out" ;;
        vllm-capture) timeout "$cap" $py "$G/benchmarks/frameworks/vllm_gpu.py" --capture-max 4096 \
                          --skip eager,recompute,bi --budget-s $((cap - 15)) --out "$out" ;;
        loop) timeout "$cap" $py "$G/benchmarks/frameworks/loop_gpu.py" --out "$out" --native-rounds 3 ;;
        moe-loop)  # moe_loop_gpu.py: a Qwen3-MoE model, R/R ($MOE_ROUNDS, default 5) + P/P (3 rounds), rlk-validate on
            # both; the site must carry vLLM's MoE kernels (MOE=1 prepare) for P/P's fused MoE; $MOE_MODEL, $MOE_PROMPTS
            [ -f /tmp/site/vllm/_moe_C.abi3.so ] || echo "moe-loop: the site has no vllm/_moe_C.abi3.so (prepare with MOE=1)"
            timeout "$cap" $py "$G/benchmarks/frameworks/moe_loop_gpu.py" --out "$out" \
                --model "${MOE_MODEL:-qwen3-moe-30b-a3b-L2}" --rounds "${MOE_ROUNDS:-5}" --prompts "${MOE_PROMPTS:-64}" \
                --rr-cap-s $(( (cap - 40) * 3 / 5 )) --pp-cap-s $(( (cap - 40) * 2 / 5 - 40 )) \
                > "$out/moe-loop.log" 2>&1
            echo "moe_loop_gpu rc $?"; tail -20 "$out/moe-loop.log"; rm -rf "$out/plugin-site" ;;
        tp-emu-loop)  # tp_emu_loop_gpu.py (issue 35): vLLM TP 1, Megatron at emulated TP 4 + SP, R/R, then bi-control
            timeout "$cap" $py "$G/benchmarks/frameworks/tp_emu_loop_gpu.py" --out "$out" \
                --rounds "${TP_EMU_ROUNDS:-6}" --rr-cap-s $(( (cap - 30) * 3 / 4 )) --bi-cap-s $(( (cap - 30) / 4 - 10 )) \
                > "$out/tp-emu-loop.log" 2>&1
            echo "tp_emu_loop_gpu rc $?"; tail -20 "$out/tp-emu-loop.log"; rm -rf "$out/plugin-site" ;;
        matrix-a) timeout "$cap" $py "$G/benchmarks/frameworks/loop_gpu.py" --out "$out" --rounds 2 --prompts 32 \
                      --max-new-tokens 64 --matrix control-RR,native-PP,attention-RP,attention-PR \
                      --matrix-cap-s $((cap - 20)) ;;
        matrix-b) timeout "$cap" $py "$G/benchmarks/frameworks/loop_gpu.py" --out "$out" --rounds 2 --prompts 32 \
                      --max-new-tokens 64 --matrix ffn-RP,ffn-PR,logp-RP,logp-PR --matrix-cap-s $((cap - 20)) ;;
        hybrid) timeout "$cap" $py "$G/benchmarks/frameworks/megatron_gpu.py" --hybrid --out "$out" ;;
        ladder) timeout "$cap" $py "$G/benchmarks/frameworks/ladder_gpu.py" --out "$out" --budget-s $((cap - 20)) \
                    ${LADDER_RUNGS:+--rungs "$LADDER_RUNGS"} ;;
        attribute)  # issue 38: attribute_gpu.py — rlk-repro attribute on the ladder stage's 0-aligned, 1-fp8, 2-top-p and
            # rr-0-aligned rungs (+ an injected R/R control); runs a one-round ladder of them first if no ladder stage ran
            timeout "$cap" $py "$G/benchmarks/frameworks/attribute_gpu.py" --ladder /tmp/sit/ladder --out "$out" \
                --budget-s $((cap - 20)) ;;
        filtered)  # filtered_gpu.py: R/R and P/P runs with top-k / top-p / min-p ($FILTERED_ONLY, $FILTERED_ROUNDS,
            # $FILTERED_PP_ROUNDS, $FILTERED_LR)
            timeout "$cap" $py "$G/benchmarks/frameworks/filtered_gpu.py" --out "$out" --budget-s $(( cap - 20 )) \
                ${FILTERED_ONLY:+--only "$FILTERED_ONLY"} ${FILTERED_ROUNDS:+--rounds "$FILTERED_ROUNDS"} \
                ${FILTERED_PP_ROUNDS:+--pp-rounds "$FILTERED_PP_ROUNDS"} ${FILTERED_LR:+--lr "$FILTERED_LR"} ;;
        processed)  # bench_processed_logprobs.py (kernels as built: run after cuda)
            (cd "$G/benchmarks" && RLK_BENCH_OUT="$out" timeout "$cap" $py bench_processed_logprobs.py \
                > "$out/processed.log" 2>&1); tail -20 "$out/processed.log" ;;
        linear-tp)  # bench_linear_tp.py (kernels as built: run after cuda, or rlk.triton's JIT serves)
            # shellcheck disable=SC2086
            (cd "$G/benchmarks" && RLK_BENCH_OUT="$out" timeout "$cap" $py bench_linear_tp.py ${LINEAR_TP_ARGS:-} \
                > "$out/linear_tp.log" 2>&1); tail -30 "$out/linear_tp.log" ;;
        vllm-mp)  # R/R only, the engine core in its own process (vLLM's default): its readbacks must carry what ran
            timeout "$cap" $py "$G/benchmarks/frameworks/vllm_gpu.py" --multiprocessing --skip pp,bi --prompts 64 \
                --gen-budget-s 15 --gen-repeats 1 --budget-s $((cap - 15)) --out "$out" ;;
        megatron) timeout "$cap" $py "$G/benchmarks/frameworks/megatron_gpu.py" --budget-s $((cap - 40)) --out "$out" ;;
        tp-cost-vllm|tp-cost-vllm-8b)  # issue 35: R/R with RL_KERNEL_TP_INVARIANT (rr_tp) against R/R without (rr)
            local model=""
            [ "$name" = tp-cost-vllm-8b ] && model="--model qwen3-8b-L8"
            # shellcheck disable=SC2086
            timeout "$cap" $py "$G/benchmarks/frameworks/vllm_gpu.py" --tp-invariant "${TP_COST_G:-8}" --skip pp,bi \
                $model --gen-budget-s 20 --gen-repeats 3 --budget-s $((cap - 15)) --out "$out" ;;
        moe-bench)  # issue 36: bench_moe.py (the MoE layer vs vLLM's fused MoE), then megatron_moe_gpu.py (the step)
            local t0=$SECONDS
            [ -f /tmp/site/vllm/_moe_C.abi3.so ] || echo "moe-bench: the site has no vllm/_moe_C.abi3.so (prepare with" \
                "MOE=1): bench_moe.py skips vLLM's side"
            # shellcheck disable=SC2086
            (cd "$G/benchmarks" && RLK_BENCH_OUT="$out" timeout $((cap / 2)) $py bench_moe.py ${MOE_BENCH_ARGS:-} \
                > "$out/bench_moe.log" 2>&1)
            echo "bench_moe rc $?"; tail -16 "$out/bench_moe.log"
            timeout $((cap - (SECONDS - t0) - 5)) $py "$G/benchmarks/frameworks/megatron_moe_gpu.py" --out "$out" \
                --model "${MOE_MODEL:-qwen3-moe-30b-a3b-L2}" --budget-s $((cap - (SECONDS - t0) - 15)) \
                > "$out/megatron_moe.log" 2>&1
            echo "megatron_moe_gpu rc $?"; tail -12 "$out/megatron_moe.log" ;;
        tp-cost-megatron)  # issue 35: the rlk training step without and with RL_KERNEL_TP_INVARIANT
            timeout "$cap" $py "$G/benchmarks/frameworks/megatron_gpu.py" --tp-cost "${TP_COST_G:-8}" \
                --budget-s $((cap - 30)) --out "$out" ;;
        cuda)
            # $RLK_BUILD_OPS / $RLK_BUILD_DTYPES (setup.py) limit the AOT families and dtypes built (the GPU suite skips,
            # by name, what the build left out; the logp sweep needs linear and linear_backward built too: its chunk
            # GEMMs); $BUILD_CAP caps the build (default 200 s; fp32 attention backward compiles slowly: ~150 s for
            # the fp16 + fp32 attention families with 16 jobs)
            local t0=$SECONDS
            (cd "$G/packages/rlk-core" && RLK_BUILD_EXT=1 RLK_BUILD_JOBS=16 timeout "${BUILD_CAP:-200}" $py setup.py \
                build_ext --inplace > "$out/build.log" 2>&1)
            echo "build rc $? in $((SECONDS - t0)) s"; tail -2 "$out/build.log"
            # shellcheck disable=SC2086
            (cd "$G" && RLK_REQUIRE_GPU=1 timeout $((cap - (SECONDS - t0) - ${HOST_CAP:-90} - 10)) $py -m pytest -q -p no:cacheprovider \
                --durations=10 -m "${CUDA_MARK:-gpu and not multi_gpu}" ${CUDA_TESTS_K:+-k "$CUDA_TESTS_K"} \
                ${CUDA_TESTS:-tests/gpu/test_cuda_backend_gpu.py tests/gpu/test_logprobs_gpu.py} > "$out/gpu-tests.log" 2>&1)
            tail -25 "$out/gpu-tests.log"
            if [ "${HOST_CAP:-90}" != 0 ]; then  # HOST_CAP=0: no host_overhead.py
                (cd "$G/benchmarks" && RLK_BENCH_OUT="$out" timeout "${HOST_CAP:-90}" $py host_overhead.py \
                    --sections "${HOST_SECTIONS:-rowwise,linear_eager}" > "$out/host.log" 2>&1)
                tail -30 "$out/host.log"
            fi ;;
        exact|exact-*)  # the framework tests (real vLLM / megatron-core), zero tolerance; pytest's tmp under $out
            local files=tests/frameworks
            [ "$name" = exact ] || files=tests/frameworks/test_${name#exact-}_exact.py
            (cd "$G" && RLK_REQUIRE_GPU=1 timeout "$cap" $py -m pytest -q -p no:cacheprovider -rA --durations=10 \
                -m "${EXACT_MARK:-gpu and not multi_gpu}" --basetemp="$out/tmp" --junitxml="$out/junit.xml" "$files" \
                > "$out/exact.log" 2>&1)
            echo "pytest rc $?"; tail -25 "$out/exact.log"
            # keep the workers' reports, logs and validations, and the R/R loop's run directory (rr-run/); drop
            # pytest's tmp (the P/P run, the plugin sites)
            mkdir -p "$out/reports"
            (cd "$out/tmp" 2>/dev/null && find . -maxdepth 2 \( -name '*_exact*.json' -o -name '*_exact*.md' \
                -o -name '*.log' -o -name '*-validation.json' \) -exec cp --parents {} "$out/reports/" \;)
            for rr in "$out"/tmp/*/runs/consistency/*/; do [ -d "$rr" ] && cp -r "$rr" "$out/rr-run" && break; done
            rm -rf "$out/tmp" ;;
        tests)  # the GPU tests in $GPU_TESTS on the shipped code, no build (rlk.cuda absent: rlk.triton serves)
            # shellcheck disable=SC2086
            (cd "$G" && RLK_REQUIRE_GPU=1 timeout "$cap" $py -m pytest -q -p no:cacheprovider --durations=15 \
                ${GPU_TESTS:-tests/gpu} > "$out/gpu-tests.log" 2>&1)
            tail -40 "$out/gpu-tests.log" ;;
        local) (cd "$G/benchmarks" && RLK_BENCH_OUT="$out" timeout "$cap" $py bench_local_engine.py --device cuda \
                   --model qwen3-0.6b --rounds 8 --prompts 32 --samples 8 --max-new-tokens 60 --max-num-seqs 256 \
                   --chunk-size 16 --page-size 16 > "$out/local.log" 2>&1) ;;
        learn|learn-a|learn-b)  # learn_gpu.py (issue 37): its work directory /tmp/learn outlives the stage (learn-b
            # reads learn-a's); the checkpoints and train-data stay there, $out gets the records, runs and report
            local parts=prep,native,consistency,finish
            [ "$name" = learn-a ] && parts=prep,native
            [ "$name" = learn-b ] && parts=consistency,finish
            # shellcheck disable=SC2086
            timeout "$cap" $py "$G/benchmarks/frameworks/learn_gpu.py" --out "$out" --work /tmp/learn --parts "$parts" \
                --budget-s $((cap - 15)) ${LEARN_ARGS:-} > "$out/learn.log" 2>&1
            echo "learn_gpu rc $?"; tail -30 "$out/learn.log" ;;
        profile)  # the rollout step under cProfile (benchmarks/profile_rollout.py; $PROFILE_MODE, default consistency)
            (cd "$G/benchmarks" && timeout "$cap" $py profile_rollout.py --device cuda --model qwen3-0.6b --rounds 2 \
                 --prompts 32 --samples 8 --max-new-tokens 60 --max-num-seqs 256 --chunk-size 16 --page-size 16 \
                 --mode "${PROFILE_MODE:-consistency}" --out "$out" > "$out/profile.log" 2>&1)
            rm -rf "$out/runs" ;;
        *) echo "unknown stage $name"; return 2 ;;
    esac
    echo "rc $? after $(date +%T)"
    tail -5 "$out"/*.md 2>/dev/null | tail -15
    tar -czf "$OUT/$name.tar.gz" -C /tmp/sit "$name"
}

run() {
    for spec in "$@"; do
        local name=${spec%%:*} cap=${spec#*:}
        [ "$cap" = "$spec" ] && cap=${CAP[$name]:-300}
        stage "$name" "$cap"
    done
}

CAP[ladder]=420  # issue 38 (set here, apart from the CAP table that other stages edit)
CAP[attribute]=560  # issue 38
CAP[learn-a]=540; CAP[learn-b]=480; CAP[learn]=590  # issue 37 (learn_gpu.py caps its parts inside these)
CAP[tp-cost-vllm]=480; CAP[tp-cost-vllm-8b]=580; CAP[tp-cost-megatron]=420  # issue 35
CAP[moe-bench]=300  # issue 36 (bench_moe.py within half of it, megatron_moe_gpu.py the rest)

cmd=${1:-}; shift || true
case $cmd in
    prepare) prepare ;;
    recv) recv "$1" ;;
    recv-last) k=$1; shift; recv_last "$k" && run "$@" ;;
    prepare-lite) prepare_lite ;;
    recv-lite) recv_lite && run "$@" ;;
    run) run "$@" ;;
    *) sed -n '2,/^set -u/p' "$0" | grep -v '^set -u'; exit 2 ;;
esac
