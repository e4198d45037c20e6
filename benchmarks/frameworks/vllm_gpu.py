#!/usr/bin/env python3
"""Throughput of rlk-vllm-plugin inside real vLLM against vLLM's own kernels, one GPU (``--tp 2``: two). The bitwise
checks (R/R rollout == training recompute, alone == batch, eager == CUDA graphs, the P/P negative control, the
readbacks) are tests: ``tests/frameworks/test_vllm_exact.py``; the engines, stages and driver are theirs
(``tests/frameworks/vllm_stages.py``).

    PYTHONPATH=/tmp/site:packages/rlk-core/src:packages/rlk-validate/src:packages/rlk-collectives/src:\
packages/rlk-vllm-plugin/src:packages/rlk-repro/src python3 benchmarks/frameworks/vllm_gpu.py --out $OUT

Stages, each in its own process: ``ckpt`` (Qwen3-0.6B-shaped random bf16 checkpoint + token-id prompts); ``rr`` (every
module R/R strict, ``attention_backend=CUSTOM``, CUDA graphs), ``pp`` (the plugin off: vLLM's own kernels) and ``bi``
(P/P with ``VLLM_BATCH_INVARIANT=1``, vLLM's deterministic mode), each: a warm-up, the big ``generate`` (prompts x
samples, ``logprobs=0``, T=1, top_p 1, top_k 0, ignore_eos; R/R sized down to ``--gen-budget-s`` from the warm-up
rate, floor 64 prompts, and the others take its count) timed ``--gen-repeats`` times on a cleared prefix cache by
``harness.wall_times`` (the rate is the median; the SM clock before each), the time to first token of one fresh
prompt (median of ``--ttft-runs``) and one decode step of ``--decode-batch`` requests. ``--profile``: torch.profiler
tables of a decode and a mixed run per engine stage. ``vllm_gpu.json`` / ``.md`` in ``--out``: every stage, and R/R's
output tok/s over native's and over the batch-invariant mode's (the targets: >= 0.8x native, faster than BI).
``--device cpu --tiny`` runs rlk-repro's local engine as the stand-in (a smoke run; the figures mean nothing).

The cost of TP-invariant mode (issue 35): ``--tp-invariant G`` adds the stage ``rr_tp`` after ``rr`` — the same R/R
engine with ``RL_KERNEL_TP_INVARIANT=G`` (o_proj and down_proj under ``rlk.gemm.tp.v1``; ``rr`` runs with the
variable cleared), the same prompts — and ``tp_cost`` in the JSON: ``rr``'s output tok/s over ``rr_tp``'s (the time
ratio of invariant mode, target <= 1.10), the decode-step and TTFT ratios, and the row-parallel ops each stage's
readbacks counted (``linear_tp`` at TP 1: the mode was on; none in ``rr``). ``--model qwen3-8b-L<n>``: a random
model of Qwen3-8B's layer shape with ``n`` layers (tied embedding) instead of the 0.6B shape; ``--skip pp,bi`` keeps
the run to the two R/R stages (the sitting's ``tp-cost-vllm`` / ``tp-cost-vllm-8b``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for _p in (_ROOT / "benchmarks", _ROOT / "tests" / "frameworks"):  # the timing harness; the tests' engine stages
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import vllm_stages as V  # noqa: E402
from harness import wall_times  # noqa: E402

ORDER = ("ckpt", "rr", "pp", "bi")
ORDER_TP = ("ckpt", "rr", "rr_tp", "pp", "bi")  # --tp-invariant G
CAPS = {"ckpt": 120, "rr": 260, "rr_tp": 260, "pp": 170, "bi": 170}  # per-stage wall-clock caps (s)
CKPT_CAP_8B = 300  # the random checkpoint of a qwen3-8b-L<n> model (billions of parameters drawn on the CPU)
TARGETS = {"rr_vs_native": ">= 0.8", "rr_vs_batch_invariant": "> 1"}
TP_COST_TARGET = 1.10  # issue 35: invariant mode at most 10% slower end to end


def stage_time(a, work: Path, name: str) -> dict:
    prompts_all = V.prompts_of(work)
    n_prompts = a.num_prompts or a.prompts
    engine = V.open_engine(a, work, name)
    res = V.engine_info(engine, name)
    # warm-up (Triton JIT of shapes the capture did not cover); also the throughput estimate for sizing
    warm_p = list(range(min(a.warm_prompts, n_prompts)))
    engine.generate(a, [prompts_all[i] for i in warm_p], warm_p, a.samples, min(8, a.max_tokens))  # JIT
    _, warm_s = V._timed(lambda: engine.generate(a, [prompts_all[i] for i in warm_p], warm_p, a.samples,
                                                 a.max_tokens))
    warm_tps = len(warm_p) * a.samples * a.max_tokens / max(warm_s, 1e-9)
    res["warmup"] = {"prompts": len(warm_p), "seconds": round(warm_s, 2), "output_tok_s": round(warm_tps)}
    if name == "rr" and a.engine == "vllm" and not a.num_prompts:
        # size the big run to the time budget (the warm-up rate underestimates the big batch's)
        fit = int(a.gen_budget_s * warm_tps / (a.samples * a.max_tokens))
        if fit < n_prompts:
            res["reduced"] = {"from_prompts": n_prompts, "to_prompts": max(fit, 64),
                              "why": f"warm-up rate {warm_tps:.0f} tok/s x gen budget {a.gen_budget_s}s"}
            n_prompts = max(fit, 64)
    idx = list(range(n_prompts))

    def before():  # each timed run prefills every prompt again: the prefix cache cleared, the SM clock read
        engine.reset_prefix_cache()
        return V._sm_clock_mhz()

    runs = wall_times(lambda: engine.generate(a, [prompts_all[i] for i in idx], idx, a.samples, a.max_tokens),
                      a.gen_repeats, before)
    out_tokens = sum(len(r["tokens"]) for r in runs["result"])
    res["generate"] = {"prompts": n_prompts, "samples": a.samples, "max_tokens": a.max_tokens,
                       "sequences": len(runs["result"]), "output_tokens": out_tokens,
                       "seconds": round(runs["median_s"], 3),
                       "seconds_each": [round(t, 3) for t in runs["seconds_each"]],
                       "sm_clock_mhz_before_each": runs["before_each"],
                       "output_tok_s": round(out_tokens / runs["median_s"], 1)}
    # TTFT: wall time of generate(max_tokens=1) for one fresh prompt (no prefix-cache hit), median
    base = a.prompts
    ttft = []
    for j in range(a.ttft_runs):
        i = base + j
        _, s = V._timed(lambda i=i: engine.generate(a, [prompts_all[i]], [i], 1, 1))
        ttft.append(s)
    # decode step: a batch of fresh prompts, max_tokens 1 (prefill, caches the prompts) then 1 again
    # (cached prefill) then 1 + K: (t(1+K) - t(1)) / K is one decode step of the whole batch
    d_idx = list(range(base + a.ttft_runs, base + a.ttft_runs + a.decode_batch))
    d_p = [prompts_all[i] for i in d_idx]
    engine.generate(a, d_p, d_idx, 1, 1)
    _, t1 = V._timed(lambda: engine.generate(a, d_p, d_idx, 1, 1))
    _, tk = V._timed(lambda: engine.generate(a, d_p, d_idx, 1, 1 + a.decode_steps))
    res["timing"] = {"ttft_single_ms_median": round(1e3 * statistics.median(ttft), 2) if ttft else None,
                     "ttft_single_ms": [round(1e3 * s, 2) for s in ttft],
                     "decode_batch": len(d_idx), "decode_steps": a.decode_steps,
                     "decode_step_ms": round(1e3 * (tk - t1) / a.decode_steps, 3),
                     "note": "wall times of LLM.generate (front end included); decode step from "
                             "t(max_tokens=1+K) - t(max_tokens=1) over K, prompts prefix-cached"}
    if a.profile:
        res["profile"] = _profile(a, engine, prompts_all, work, name)
    res.update(V.engine_readbacks(a, engine))
    V.close_engine(engine)
    return res


def _gpu_clocks() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,"
                               "clocks_throttle_reasons.active", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # informational only
        return f"{type(exc).__name__}: {exc}"


def _profile(a, engine, prompts_all, work: Path, name: str) -> dict:
    """``--profile``: torch.profiler (CPU + CUDA) over a decode run of the timing batch and over a mixed
    run (prefill + decode, the throughput case); the tables go to ``<work>/profile-<stage>.txt`` (the driver
    copies them to ``--out``). Where the time goes, per kernel and per host op, for R/R beside P/P."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    base = a.prompts + a.ttft_runs
    d_idx = list(range(base, base + a.decode_batch))
    m_idx = list(range(min(32, a.prompts)))
    runs = {"decode": lambda: engine.generate(a, [prompts_all[i] for i in d_idx], d_idx, 1, 1 + a.decode_steps),
            "mixed": lambda: engine.generate(a, [prompts_all[i] for i in m_idx], m_idx, a.samples, a.max_tokens)}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: dict = {"clocks_before": _gpu_clocks()}
    lines = [f"# profile of stage {name}", f"clocks before: {out['clocks_before']}", ""]
    for what, fn in runs.items():
        engine.reset_prefix_cache()
        fn()  # same shapes once unprofiled (JIT, allocator)
        sync()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall = time.perf_counter() - t0
        ka = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in ka) / 1e3
        out[what] = {"wall_ms": round(1e3 * wall, 1), "self_cuda_ms_total": round(cuda_total, 1)}
        lines += [f"## {what}: wall {1e3 * wall:.1f} ms, summed self CUDA time {cuda_total:.1f} ms", ""]
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            lines += [f"### by {key}", ka.table(sort_by=key, row_limit=30, max_name_column_width=90), ""]
    out["clocks_after"] = _gpu_clocks()
    (work / f"profile-{name}.txt").write_text("\n".join(lines) + "\n")
    return out


def evaluate(result: dict, work: Path) -> None:
    st = result["stages"]
    tps = {n: st[n]["result"]["generate"]["output_tok_s"] for n in ("rr", "pp", "bi")
           if (st.get(n, {}).get("result") or {}).get("generate")}
    ratios = {}
    if "rr" in tps and "pp" in tps:
        ratios["rr_vs_native"] = round(tps["rr"] / tps["pp"], 3)
    if "rr" in tps and "bi" in tps:
        ratios["rr_vs_batch_invariant"] = round(tps["rr"] / tps["bi"], 3)
    result["throughput"] = {"output_tok_s": tps, "ratios": ratios, "targets": TARGETS}
    if "rr_tp" in st:
        result["tp_cost"] = tp_cost(st, work)


def tp_cost(st: dict, work: Path) -> dict:
    """Invariant mode's end-to-end cost: ``rr`` (off) against ``rr_tp`` (``RL_KERNEL_TP_INVARIANT=G``), the same
    engine, prompts and sizes. ``time_ratio`` = off's output tok/s over invariant's (> 1: invariant is slower); the
    decode step and TTFT as ratios of invariant's milliseconds over off's; the row-parallel op calls in each stage's
    readbacks (``linear_tp`` / ``linear_tp_partials``), which say whether the mode ran."""
    res = {n: (st.get(n, {}).get("result") or {}) for n in ("rr", "rr_tp")}
    out: dict = {"target_time_ratio": f"<= {TP_COST_TARGET}",
                 "row_parallel_calls": {n: _row_parallel_calls(work / "readbacks" / n) for n in res}}
    calls = out["row_parallel_calls"]
    out["invariant_mode_ran"] = bool(calls["rr_tp"].get("linear_tp")) and not any(calls["rr"].values())
    gen = {n: r.get("generate") or {} for n, r in res.items()}
    tim = {n: r.get("timing") or {} for n, r in res.items()}
    if gen["rr"].get("output_tok_s") and gen["rr_tp"].get("output_tok_s"):
        out["output_tok_s"] = {n: g["output_tok_s"] for n, g in gen.items()}
        out["time_ratio"] = round(gen["rr"]["output_tok_s"] / gen["rr_tp"]["output_tok_s"], 4)
        # a pass only where the mode ran (the local stand-in engine does not wire it: its ratio is noise)
        out["within_target"] = out["invariant_mode_ran"] and out["time_ratio"] <= TP_COST_TARGET
    for key, name in (("decode_step_ms", "decode_step_ratio"), ("ttft_single_ms_median", "ttft_ratio")):
        if tim["rr"].get(key) and tim["rr_tp"].get(key):
            out[name] = round(tim["rr_tp"][key] / tim["rr"][key], 4)
    return out


def _row_parallel_calls(rb_dir: Path) -> dict:
    """Calls of ``linear_tp`` and ``linear_tp_partials`` over every readback of a stage (a compiled call site counts
    once, at trace)."""
    calls = {"linear_tp": 0, "linear_tp_partials": 0}
    for f in sorted(rb_dir.rglob("*.json")) if rb_dir.is_dir() else []:
        try:
            mods = json.loads(f.read_text()).get("modules") or {}
        except (OSError, ValueError):
            continue
        for m in mods.values():
            for op in calls:
                calls[op] += int(((m.get("ops") or {}).get(op) or {}).get("call_count", 0))
    return calls


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = ["# rlk-vllm-plugin in real vLLM: throughput against vLLM's own kernels", "",
             f"GPU: {m.get('gpu')} · torch {m.get('torch')} · vLLM {m.get('vllm')} · Triton {m.get('triton')} · "
             f"RLK_COMMIT {m.get('RLK_COMMIT')} · engine {m.get('engine')}", "",
             f"R/R output tok/s over native and over the batch-invariant mode: "
             f"{(result.get('throughput') or {}).get('ratios')} (targets {TARGETS})", ""]
    cost, g_leaves = result.get("tp_cost"), result["settings"].get("tp_invariant")
    if cost:
        lines += [f"TP-invariant mode (rr_tp, RL_KERNEL_TP_INVARIANT={g_leaves}) against off (rr): time "
                  f"ratio {cost.get('time_ratio')} (target {cost['target_time_ratio']}, within: "
                  f"{cost.get('within_target')}), decode step {cost.get('decode_step_ratio')}, TTFT "
                  f"{cost.get('ttft_ratio')}; the mode ran: {cost['invariant_mode_ran']} (row-parallel calls "
                  f"{cost['row_parallel_calls']})", ""]
    lines += ["| stage | status | seconds | output tok/s (median) | timed generates s (SM MHz before) | "
              "TTFT ms (single) | decode step ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in result["stages"].items():
        r = s.get("result") or {}
        g, t = r.get("generate") or {}, r.get("timing") or {}
        each = ", ".join(f"{x} ({c})" for x, c in zip(g.get("seconds_each", []), g.get("sm_clock_mhz_before_each", [])))
        lines.append(f"| {name} | {s.get('status')} | {s.get('seconds')} | {g.get('output_tok_s', '')} | {each} | "
                     f"{t.get('ttft_single_ms_median', '')} | {t.get('decode_step_ms', '')} |")
    errs = [(n, s["error"]) for n, s in result["stages"].items() if s.get("error")]
    if errs:
        lines += ["", "## Errors", ""] + [f"- `{n}`: {e[:500]}" for n, e in errs]
    return "\n".join(lines) + "\n"


STAGES = {"ckpt": V.stage_ckpt, **{n: (lambda a, w, n=n: stage_time(a, w, n)) for n in ("rr", "rr_tp", "pp", "bi")}}


def main(argv=None) -> int:
    p = V.parser(__doc__.split("\n\n")[0], ORDER_TP)
    p.add_argument("--warm-prompts", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--gen-budget-s", type=float, default=60.0, help="the R/R big generate is sized to this")
    p.add_argument("--gen-repeats", type=int, default=3, help="timed runs of the big generate (tok/s: their median)")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of a decode and a mixed run per "
                   "engine stage -> profile-<stage>.txt in --out")
    p.add_argument("--tp-invariant", type=int, default=0, metavar="G",
                   help="add stage rr_tp: R/R with RL_KERNEL_TP_INVARIANT=G (invariant mode's cost against rr)")
    p.add_argument("--model", default="", help="qwen3-8b-L<n> (Qwen3-8B's layer shape, n layers, random weights) "
                   "instead of the Qwen3-0.6B shape")
    a = V.checked(p, p.parse_args(argv))
    if a.model:
        try:
            V._model_cfg(a.tiny, a.model)
        except (KeyError, ValueError):
            p.error(f"--model {a.model!r}: a preset's name or {V.QWEN3_8B_LAYERS}<layers>")
    if a.tp_invariant and (a.tp_invariant < 2 or a.tp_invariant & (a.tp_invariant - 1)):
        p.error(f"--tp-invariant {a.tp_invariant}: G is a power of two >= 2")
    a.passed = (*V.COMMON, "warm_prompts", "decode_steps", "gen_budget_s", "gen_repeats", "profile", "tp_invariant",
                "model")
    if a.tp_invariant:  # the engine of stage rr_tp: rr's, with the variable (every other stage has it cleared)
        V.ENGINES["rr_tp"] = {**V.ENGINES["rr"], "env": {"RL_KERNEL_TP_INVARIANT": str(a.tp_invariant)}}
    if a.stage:
        return V.run_stage(a, STAGES)
    caps = dict(CAPS, ckpt=CKPT_CAP_8B) if a.model.startswith(V.QWEN3_8B_LAYERS) else CAPS
    result = V.drive(a, Path(__file__).resolve(), "vllm_gpu", ORDER_TP if a.tp_invariant else ORDER, caps, evaluate,
                     markdown)
    for prof in Path(result["work_dir"]).glob("profile-*.txt"):
        (Path(a.out) / prof.name).write_bytes(prof.read_bytes())
    V.finish_work(result, a.keep_work)
    ran = not any(s["status"] == "failed" for s in result["stages"].values()) and "evaluate_error" not in result
    print(json.dumps({"stages": {n: s["status"] for n, s in result["stages"].items()},
                      "throughput": result.get("throughput"), "tp_cost": result.get("tp_cost")}, indent=1))
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
