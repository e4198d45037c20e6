#!/usr/bin/env python3
"""A model that learns (issue 37), on one H200: the synthetic math set, a ~190M Qwen3-shaped model warm-started on
it, then GRPO with the deepscaler rule reward through the frameworks engine (real vLLM + real megatron-core), the
``convergence`` phase shortened to ``--rounds`` (>= 100), native (P/P) and consistency (R/R) on the same seed, each
run validated, then ``rlk-repro report`` over the pair (the four plots, the paired summary table).

Parts (``--parts``, in this order; each its own process, killed at its cap):

- ``prep``: ``rlk-repro synthetic-math`` (splits sft / rl / heldout, tokenizer, random checkpoint) and ``rlk-repro
  warmstart --device cuda`` (held-out loss and deepscaler accuracy of greedy answers before / after);
- ``native`` / ``consistency``: ``rlk-repro run --engine frameworks --workspace W --apply-chat-template --phase
  convergence --phase-rounds R --mode M --seed 1234`` into ``W/runs/learn/seed1234-<mode>``;
- ``finish``: ``rlk-validate`` on both runs (``--require-bitwise`` for R/R), ``rlk-repro report`` on the pair, the
  results copied into ``--out`` (run directories without their train-data, which stay in ``--work``).

The work directory (``--work``, default /tmp/learn: workspace, checkpoints, run directories) is kept between
calls on a warm machine, so the parts can be split over two device calls (sitting stages ``learn-a`` = prep +
native, ``learn-b`` = consistency + finish; ``learn`` = all four in one call). ``learn_gpu.json`` / ``learn_gpu.md``
in ``--out`` say what ran, how long each part took, the warm start's numbers, each run's exposure, mismatches,
reward over the rounds and validation, and the checks (R/R 0 mismatches over the whole exposure, >= 100 rounds,
P/P differs, rlk-validate passed, the four plots written).

    PYTHONPATH=/tmp/site:/tmp/mcore:packages/rlk-core/src:packages/rlk-validate/src:packages/rlk-collectives/src:\
packages/rlk-vllm-plugin/src:packages/rlk-megatron-provider/src:packages/rlk-repro/src \
    python3 benchmarks/frameworks/learn_gpu.py --out $OUT --parts prep,native,consistency,finish
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_gpu import _dump, _env, _stage, _write_plugin_site  # one stage runner, one plugin dist-info writer

PARTS = ("prep", "native", "consistency", "finish")
PLOTS = ("consistency.png", "learning.png", "optimization.png", "performance.png")
SEED = 1234  # the convergence phase's seed
#: what --budget-s keeps back for each part still to come (seconds)
RESERVE = {"prep": 90, "native": 160, "consistency": 160, "finish": 40}


def _rlk(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlk_repro", *args]


def _prep(a, w: Path, env: dict, out: Path, res: dict) -> None:
    res["stages"]["synthetic-math"] = _stage("synthetic-math", _rlk(
        "synthetic-math", "--workspace", str(w), "--sft-rows", str(a.sft_rows), "--rl-rows", str(a.rl_rows),
        "--heldout-rows", str(a.heldout_rows), "--shape", a.shape, "--vocab-size", str(a.vocab_size), "--seed",
        str(SEED)), env, a.prep_cap_s / 4, out)
    res["stages"]["warmstart"] = _stage("warmstart", _rlk(
        "warmstart", "--workspace", str(w), "--device", a.device, "--steps", str(a.ws_steps), "--batch-size",
        str(a.ws_batch), "--lr", repr(a.ws_lr), "--warmup", str(a.ws_warmup), "--eval-rows", str(a.ws_eval_rows),
        "--eval-max-new-tokens", str(a.ws_eval_tokens), "--log-every", "50", "--seed", str(SEED)), env,
        a.prep_cap_s * 3 / 4, out)


def _run(a, w: Path, mode: str, env: dict, out: Path, res: dict) -> None:
    if not (w / "workspace.json").is_file() or not sorted((w / "models").glob("*-warm/warmstart.json")):
        res["stages"][mode] = {"rc": None, "error": f"no warm-started workspace at {w}: the prep part (stage learn-a) "
                               "must run first on this machine, and the pair needs that one checkpoint"}
        return
    runs = w / "runs" / "learn"
    runs.mkdir(parents=True, exist_ok=True)
    name = f"seed{SEED}-{mode}"
    if (runs / name).exists():  # an earlier try of this part: run it afresh
        shutil.rmtree(runs / name)
    cmd = _rlk("run", "--engine", "frameworks", "--workspace", str(w), "--apply-chat-template", "--phase",
               "convergence", "--phase-rounds", str(a.rounds), "--mode", mode, "--seed", str(SEED),
               "--prompts-per-round", str(a.prompts), "--samples-per-prompt", str(a.samples), "--max-new-tokens",
               str(a.max_new_tokens), "--temperature", repr(a.temperature), "--top-p", "1.0", "--lr", repr(a.lr),
               "--gpu-memory-utilization", str(a.gpu_mem), "--output", str(runs), "--run-name", name, "--debug",
               *(["--enforce-eager"] if a.enforce_eager else []))
    res["stages"][mode] = _stage(mode, cmd, env, a.run_cap_s, out)
    if (runs / name / "metrics.jsonl").is_file():  # what the run did (finish adds the validation)
        res["runs"][mode] = {**_summary(runs / name), "validation": {"rc": None, "verdict": "not yet validated"}}


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def _summary(run: Path) -> dict:
    rows = _rows(run)
    reward = [r["reward_mean"] for r in rows]
    bw = json.loads((run / "bitwise-validation.json").read_text()) if (run / "bitwise-validation.json").is_file() \
        else {}
    k = max(1, len(rows) // 10)
    return {"rounds": len(rows), "compared_tokens": sum(r["compared_tokens"] for r in rows),
            "mismatches": sum(r["mismatch_count"] for r in rows), "bitwise_file": bw.get("mismatch_count"),
            "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=None),
            "mean_abs_diff": bw.get("mean_abs_diff"),
            "reward_first_tenth": _mean(reward[:k]), "reward_last_tenth": _mean(reward[-k:]),
            "reward": [round(x, 4) for x in reward],
            "not_ended_first_tenth": _mean([1 - r["eos_finished"] / r["samples"] for r in rows[:k]]),
            "not_ended_last_tenth": _mean([1 - r["eos_finished"] / r["samples"] for r in rows[-k:]]),
            "round_seconds_median": statistics.median([r["rollout_seconds"] + r["train_seconds"]
                                                       for r in rows[1:]]) if len(rows) > 1 else None,
            "weights_changed_every_round": all(r["weights_changed"] for r in rows) if rows else None}


def _validate(run: Path, bitwise: bool, env: dict, doc: Path) -> dict:
    cmd = [sys.executable, "-m", "rlk_validate", str(run), "--json", str(doc), *(["--require-bitwise"] if bitwise
                                                                                  else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = {"rc": proc.returncode, "output": proc.stdout[-3000:] + proc.stderr[-2000:]}
    if doc.is_file():
        found = json.loads(doc.read_text())
        out["verdict"] = found.get("verdict")
    return out


def _finish(a, w: Path, env: dict, out: Path, res: dict) -> None:
    runs = w / "runs" / "learn"
    dirs = {m: runs / f"seed{SEED}-{m}" for m in ("native", "consistency")}
    for mode, run in dirs.items():
        if (run / "metrics.jsonl").is_file():
            res["runs"][mode] = {**_summary(run), "validation": _validate(run, mode == "consistency", env,
                                                                          out / f"validate-{mode}.json")}
            dest = out / "runs" / run.name  # the run directory without its train-data (kept in --work)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(run, dest, ignore=shutil.ignore_patterns("train-data", "round-state"))
    present = [str(d) for d in dirs.values() if (d / "metrics.jsonl").is_file()]
    if present:
        res["stages"]["report"] = _stage("report", _rlk("report", *present, "--output", str(out / "report")), env,
                                         120, out)
    for name in ("workspace.json",):
        if (w / name).is_file():
            shutil.copy2(w / name, out / name)
    for man in sorted((w / "data").glob("*.manifest.json")):
        shutil.copy2(man, out / man.name)
    for model in sorted((w / "models").glob("*")):
        for name in ("rlk-checkpoint.json", "warmstart.json", "config.json", "tokenizer_config.json"):
            if (model / name).is_file():
                (out / "models" / model.name).mkdir(parents=True, exist_ok=True)
                shutil.copy2(model / name, out / "models" / model.name / name)


def _warm(w: Path) -> dict | None:
    found = sorted((w / "models").glob("*-warm/warmstart.json"))
    if not found:
        return None
    doc = json.loads(found[-1].read_text())
    return {"before": {k: doc["before"][k] for k in ("heldout_loss", "accuracy", "readable")},
            "after": {k: doc["after"][k] for k in ("heldout_loss", "accuracy", "readable")},
            "train_seconds": doc["train_seconds"], "parameters": doc["parameters"], "rows": doc["after"]["rows"],
            "example": doc["after"]["example"]}


def _checks(a, out: Path, res: dict) -> dict:
    rr, pp = res["runs"].get("consistency"), res["runs"].get("native")
    checks = {}
    if rr:
        checks["rr_rounds_ge_100"] = rr["rounds"] >= max(100, a.rounds)
        checks["rr_zero_mismatches_whole_exposure"] = rr["mismatches"] == 0 and rr["compared_tokens"] > 0
        checks["rr_rlk_validate_require_bitwise"] = rr["validation"]["rc"] == 0
    if pp:
        checks["pp_rounds_ge_100"] = pp["rounds"] >= max(100, a.rounds)
        checks["pp_differs"] = pp["mismatches"] > 0
    if "report" in res["stages"]:
        checks["four_plots"] = all((out / "report" / p).is_file() for p in PLOTS)
        checks["paired_table"] = "## Phase convergence" in ((out / "report" / "metrics-summary.md").read_text()
                                                            if (out / "report" / "metrics-summary.md").is_file()
                                                            else "")
    return checks


def _markdown(res: dict) -> str:
    lines = [f"# a model that learns: synthetic math, GRPO on the frameworks engine ({res['meta'].get('gpu', '?')})",
             "", f"commit {res['meta'].get('RLK_COMMIT')}; {res.get('elapsed_s')} s in this call; settings "
             f"`{json.dumps({k: v for k, v in res['settings'].items() if k not in ('out', 'work')})}`", "",
             "| part | rc | s | note |", "| --- | --- | --- | --- |"]
    for n, s in res["stages"].items():
        lines.append(f"| {n} | {s.get('rc')} | {s.get('seconds')} | {s.get('error', '')[:120]} |")
    warm = res.get("warmstart")
    if warm:
        b, f = warm["before"], warm["after"]
        lines += ["", f"warm start ({warm['parameters'] / 1e6:.1f}M parameters, {warm['train_seconds']} s): held-out "
                  f"loss {b['heldout_loss']:.4f} -> {f['heldout_loss']:.4f}, deepscaler accuracy (greedy, "
                  f"{warm['rows']} held-out problems) {b['accuracy']:.3f} -> {f['accuracy']:.3f}, readable "
                  f"{b['readable']:.3f} -> {f['readable']:.3f}"]
    lines += ["", "| run | rounds | compared tokens | mismatches | mean abs diff | reward first 10% | reward last "
              "10% | s / round | validation |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in res["runs"].items():
        lines.append(f"| {n} | {r['rounds']} | {r['compared_tokens']} | {r['mismatches']} | {r['mean_abs_diff']} | "
                     f"{r['reward_first_tenth']} | {r['reward_last_tenth']} | {r['round_seconds_median']} | "
                     f"{r['validation'].get('verdict')} (rc {r['validation']['rc']}) |")
    lines += ["", "checks: " + ", ".join(f"{k} {v}" for k, v in res.get("checks", {}).items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/learn", help="workspace, checkpoints and runs, kept between calls")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--sft-rows", type=int, default=60_000)
    p.add_argument("--rl-rows", type=int, default=5_000)
    p.add_argument("--heldout-rows", type=int, default=512)
    p.add_argument("--shape", default="synth-190m")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--device", default="cuda", help="the warm start's device (cpu: a smoke test of prep)")
    p.add_argument("--ws-steps", type=int, default=600)
    p.add_argument("--ws-batch", type=int, default=128)
    p.add_argument("--ws-lr", type=float, default=5e-4)
    p.add_argument("--ws-warmup", type=int, default=50)
    p.add_argument("--ws-eval-rows", type=int, default=512)
    p.add_argument("--ws-eval-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=100, help="the shortened convergence phase (>= 100)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=100, help="limits vary in [max/2, max] per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-6, help="GRPO's AdamW step size")
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (a shorter start-up)")
    p.add_argument("--prep-cap-s", type=float, default=200)
    p.add_argument("--run-cap-s", type=float, default=380)
    p.add_argument("--budget-s", type=float, default=0, help="all parts together (0: each its own cap)")
    a = p.parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    if [x for x in parts if x not in PARTS]:
        p.error(f"--parts: one of {', '.join(PARTS)}")
    out, work = Path(a.out).resolve(), Path(a.work).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    _write_plugin_site(work / "plugin-site")
    env = _env(work)
    meta = {"RLK_COMMIT": os.environ.get("RLK_COMMIT"), "argv": sys.argv}
    try:
        meta["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    res = {"meta": meta, "settings": vars(a), "stages": {}, "runs": {}}
    w = work / "W"
    t0 = time.monotonic()

    def save() -> None:
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        res["warmstart"] = _warm(w) if (w / "models").is_dir() else None
        res["checks"] = _checks(a, out, res)
        _dump(out / "learn_gpu.json", res)
        (out / "learn_gpu.md").write_text(_markdown(res))

    todo = [x for x in PARTS if x in parts]
    for i, part in enumerate(todo):
        if a.budget_s:  # each part gets its cap, less what the parts after it need at least
            later = sum(RESERVE[x] for x in todo[i + 1:])
            left = a.budget_s - (time.monotonic() - t0) - later
            a.prep_cap_s, a.run_cap_s = min(a.prep_cap_s, left), min(a.run_cap_s, left)
            res.setdefault("caps", {})[part] = round(left)
        if part == "prep":
            _prep(a, w, env, out, res)
        elif part == "finish":
            _finish(a, w, env, out, res)
        else:
            _run(a, w, part, env, out, res)
        save()
    print((out / "learn_gpu.md").read_text())
    ok = all(s.get("rc") == 0 for s in res["stages"].values()) and all(res["checks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
