#!/usr/bin/env python3
"""Throughput of ``rlk-repro run --engine frameworks`` on one H200: R/R (10 rounds x 64 prompts x 8 samples x up to 80
tokens, Qwen3-0.6B shape), then native P/P, per-round rollout and training tokens/s and their R/R / P/P ratios
(medians of the rounds after the first). The loop's bitwise claim — R/R 0 mismatches, ``rlk-validate
--require-bitwise`` passes, P/P differs — is a test: ``tests/frameworks/test_loop_exact.py``; here each run's own
counts are only recorded.

    PYTHONPATH=/tmp/site:/tmp/mcore:packages/rlk-core/src:packages/rlk-validate/src:packages/rlk-collectives/src:\
packages/rlk-vllm-plugin/src:packages/rlk-megatron-provider/src:packages/rlk-repro/src \
    python3 benchmarks/frameworks/loop_gpu.py --out $OUT

Each stage is its own process (own session, killed by group at its time cap), its output in
``$OUT/logs/<stage>.log``; ``loop_gpu.json`` / ``loop_gpu.md`` are rewritten after every stage (status,
error, log tail). The plugin is found by vLLM through a dist-info on PYTHONPATH (``vllm_stages._write_plugin_site``,
no pip). Run directories land in ``$OUT/runs``. ``--tp 2`` runs each run stage under ``torchrun --nproc-per-node 2``.
``--matrix CELLS``: the route matrix instead (validated by ``rlk-repro matrix`` itself), then ``rlk-repro report``.
Exit 1 if a stage failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests" / "frameworks") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "frameworks"))
from vllm_stages import _write_plugin_site  # noqa: E402  (the one dist-info writer)

CLEARED = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "RL_KERNEL_MODE",
           "RL_KERNEL_READBACK_DIR", "RL_KERNEL_RUN_ID", "VLLM_PLUGINS", "VLLM_BATCH_INVARIANT")


def _dump(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    paths = [str(out / "plugin-site")] + [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                          if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_DISABLE_COMPILE_CACHE="1", PYTHONUNBUFFERED="1")
    return env


def _run_cmd(a, mode: str, rounds: int, runs: Path) -> list[str]:
    args = ["run", "--engine", "frameworks", "--mode", mode, "--model", a.model, "--rounds", str(rounds),
            "--prompts-per-round", str(a.prompts), "--samples-per-prompt", str(a.samples), "--max-new-tokens",
            str(a.max_new_tokens), "--gpu-memory-utilization", str(a.gpu_mem), "--output", str(runs),
            "--tp", str(a.tp), "--seed", str(a.seed), "--debug"]
    if a.tp > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.tp), "-m", "rlk_repro", *args]
    return [sys.executable, "-m", "rlk_repro", *args]


def _stage(name: str, cmd: list[str], env: dict, cap: float, out: Path) -> dict:
    log = out / "logs" / f"{name}.log"
    print(f"[loop_gpu] stage {name}: {' '.join(cmd)} (cap {cap:.0f} s)", flush=True)
    t0 = time.monotonic()
    entry: dict = {"cmd": cmd, "cap_s": round(cap)}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            entry["error"] = f"timeout after {cap:.0f} s"
    entry["rc"] = proc.returncode
    entry["seconds"] = round(time.monotonic() - t0, 1)
    text = log.read_text(errors="replace")
    entry["progress"] = [ln for ln in text.splitlines() if ln.startswith("rlk-repro: round")]
    if proc.returncode != 0 or "error" in entry:
        entry["log_tail"] = text[-5000:]
    print(f"[loop_gpu] stage {name}: rc {proc.returncode} in {entry['seconds']} s", flush=True)
    return entry


def _newest_run(runs: Path, before: set[str]) -> Path | None:
    new = sorted(p for p in runs.iterdir() if p.is_dir() and p.name not in before) if runs.is_dir() else []
    return new[-1] if new else None


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def zero_advantage_rounds(run: Path) -> list[int]:
    """The rounds whose train-data holds no non-zero advantage (no learning signal: a saturated reward; issue 41,
    item 13), read with safetensors' numpy loader (no torch needed)."""
    from safetensors.numpy import load_file

    rounds: dict[int, bool] = {}
    for f in sorted((run / "train-data").glob("round-*.safetensors")):
        rnd = int(f.name.split("-")[1].split(".")[0])
        rounds[rnd] = rounds.get(rnd, False) or bool(load_file(str(f))["advantages"].any())
    return [r for r, live in sorted(rounds.items()) if not live]


#: how much each round's evidence says (issue 41, item 13): kept per round beside the counts
EVIDENCE_KEYS = ("informative_fraction", "informative_mismatch_count", "sampled_nll_mean", "entropy_mean",
                 "max_entropy", "distinct_responses", "samples", "reward_std")


def _summary(run: Path) -> dict:
    rows = _metrics(run)
    later = rows[1:] if len(rows) > 1 else rows
    med = (lambda k: statistics.median(r[k] for r in later) if later else None)  # noqa: E731
    bw_path = run / "bitwise-validation.json"
    bw = json.loads(bw_path.read_text()) if bw_path.is_file() else {}
    return {"run_dir": str(run), "rounds": len(rows), "compared_tokens": sum(r["compared_tokens"] for r in rows),
            "mismatches": sum(r["mismatch_count"] for r in rows),
            "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=None),
            "mean_abs_diff": bw.get("mean_abs_diff"),
            "rollout_tok_s_median_after_first": med("rollout_tokens_per_s"),
            "train_tok_s_median_after_first": med("train_tokens_per_s"),
            "weight_sync_s_median": med("weight_sync_seconds"),
            "weights_changed_every_round": all(r["weights_changed"] for r in rows) if rows else None,
            "zero_advantage_rounds": zero_advantage_rounds(run),
            "per_round": [{k: r.get(k) for k in ("round", "compared_tokens", "mismatch_count", "max_abs_diff",
                                                 "rollout_tokens_per_s", "train_tokens_per_s", "rollout_seconds",
                                                 "train_seconds", "weight_sync_seconds", "reward_mean", "loss",
                                                 "vllm_parameters_changed", *EVIDENCE_KEYS)} for r in rows]}


def _markdown(res: dict) -> str:
    lines = [f"# rlk-repro run --engine frameworks on {res['meta'].get('gpu', '?')}", "",
             f"commit {res['meta'].get('RLK_COMMIT')}, TP {res['settings']['tp']}, {res.get('elapsed_s')} s", "",
             "| stage | rc | s | note |", "| --- | --- | --- | --- |"]
    for n, s in res["stages"].items():
        lines.append(f"| {n} | {s.get('rc')} | {s.get('seconds')} | {s.get('error', '')[:150]} |")
    lines += ["", "| run | rounds | compared | mismatches | max diff | rollout tok/s | train tok/s | sync s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, s in res.get("runs", {}).items():
        lines.append(f"| {n} | {s['rounds']} | {s['compared_tokens']} | {s['mismatches']} | {s['max_abs_diff']} | "
                     f"{s['rollout_tok_s_median_after_first']} | {s['train_tok_s_median_after_first']} | "
                     f"{s['weight_sync_s_median']} |")
    for k, v in res.get("ratios", {}).items():
        lines.append(f"\n{k}: {v}")
    lines.append(f"\nevery stage ran: {res.get('stages_ok', res.get('passed'))}")
    return "\n".join(lines) + "\n"


def setup(a: argparse.Namespace) -> tuple[Path, Path, dict, dict]:
    """``(out, out/runs, the stages' environment, the result document)`` for ``a.out``: the folders, the plugin's
    dist-info, the GPU and commit in the document's ``meta``."""
    out = Path(a.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runs = out / "runs"
    runs.mkdir(exist_ok=True)
    _write_plugin_site(out / "plugin-site")
    meta = {"RLK_COMMIT": os.environ.get("RLK_COMMIT"), "argv": sys.argv}
    with contextlib.suppress(Exception):
        meta["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=20).stdout.strip()
    return out, runs, _env(out), {"meta": meta, "settings": vars(a), "stages": {}, "runs": {}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--native-rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=80, help="limits vary in [max/2, max] per prompt")
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rr-cap-s", type=float, default=300)
    p.add_argument("--pp-cap-s", type=float, default=130)
    p.add_argument("--matrix", metavar="CELLS", help="instead of the R/R + P/P loop: `rlk-repro matrix --engine "
                   "frameworks --cells CELLS` (--rounds, --prompts, ... apply), then `rlk-repro report` on its root")
    p.add_argument("--matrix-cap-s", type=float, default=540)
    a = p.parse_args(argv)
    out, runs, env, res = setup(a)
    t0 = time.monotonic()

    def save():
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        _dump(out / "loop_gpu.json", res)
        (out / "loop_gpu.md").write_text(_markdown(res))

    if a.matrix:
        return _matrix(a, out, env, res, save)
    for name, mode, rounds, cap in (("rr", "consistency", a.rounds, a.rr_cap_s),
                                    ("pp", "native", a.native_rounds, a.pp_cap_s)):
        before = {q.name for q in runs.iterdir()}
        try:
            res["stages"][name] = _stage(name, _run_cmd(a, mode, rounds, runs), env, cap, out)
            run = _newest_run(runs, before)
            if run is not None:
                res["runs"][name] = _summary(run)
        except Exception as exc:  # recorded; the next stage still runs
            res["stages"].setdefault(name, {}).update(error=f"{type(exc).__name__}: {exc}",
                                                      traceback=traceback.format_exc())
        save()
    rr, pp = res["runs"].get("rr"), res["runs"].get("pp")
    if rr and pp:
        for k in ("rollout_tok_s_median_after_first", "train_tok_s_median_after_first"):
            if rr[k] and pp[k]:
                res["ratios"] = res.get("ratios", {})
                res["ratios"][k.replace("_median_after_first", "") + " R/R vs P/P"] = round(rr[k] / pp[k], 3)
    res["stages_ok"] = all(st.get("rc") == 0 for st in res["stages"].values())
    save()
    print(json.dumps({"stages_ok": res["stages_ok"], "ratios": res.get("ratios")}, indent=1))
    return 0 if res["stages_ok"] else 1


def _matrix(a, out: Path, env: dict, res: dict, save) -> int:
    """``--matrix CELLS``: the route matrix on the frameworks engine (one process per cell), validated by
    ``rlk-repro matrix`` itself (``rlk-validate matrix``), plotted by ``rlk-repro report``; per cell the
    summary of its run directory."""
    root_parent = out / "matrix"
    root_parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "rlk_repro", "matrix", "--engine", "frameworks", "--cells", a.matrix,
           "--model", a.model, "--rounds", str(a.rounds), "--prompts-per-round", str(a.prompts),
           "--samples-per-prompt", str(a.samples), "--max-new-tokens", str(a.max_new_tokens),
           "--gpu-memory-utilization", str(a.gpu_mem), "--tp", str(a.tp), "--seed", str(a.seed),
           "--output", str(root_parent)]
    res["stages"]["matrix"] = _stage("matrix", cmd, env, a.matrix_cap_s, out)
    roots = sorted(p for p in root_parent.iterdir() if p.is_dir())
    if roots:
        root = roots[-1]
        res["matrix_root"] = str(root)
        for cell in sorted(p for p in root.iterdir() if p.is_dir() and (p / "metrics.jsonl").is_file()):
            summary = _summary(cell)
            summary.pop("per_round")
            res["runs"][cell.name] = summary
        res["stages"]["report"] = _stage("report", [sys.executable, "-m", "rlk_repro", "report", str(root)], env, 120,
                                         out)
        for name in ("matrix-report.json",):
            if (root / name).is_file():
                res["matrix_validation"] = json.loads((root / name).read_text())
    res["passed"] = res["stages"]["matrix"].get("rc") == 0
    save()
    print(json.dumps({"passed": res["passed"], "cells": {k: (v["compared_tokens"], v["mismatches"])
                                                         for k, v in res["runs"].items()}}, indent=1))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
