#!/usr/bin/env python3
"""Filtered sampling in the frameworks loop (real vLLM + real Megatron, one H200): processed log-probs, contract
``rlk.logp.processed.v1``. Runs, each its own ``rlk-repro run --engine frameworks`` process:

- ``rr-t1``: R/R, top_p 0.95, top_k 40, T 1.0 (the seeds' settings);
- ``rr-t07``: R/R, top_p 0.95, top_k 40, min_p 0.05, T 0.7;
- ``pp-semantic``: P/P at rr-t07's settings with the trainer's full softmax (``--train-logprobs unfiltered``, what
  a stock trainer without kept-set replay computes): the semantic drift;
- ``pp-processed``: P/P at the same settings, both sides processed: the numerical drift under filters;
- ``pp-top-p-1``: P/P with no filter at T 0.7: the numerical drift alone;
- ``rr-ten``: R/R, no filter, T 0.9, 10 rounds at the presets' defaults (the learning-rate check of the 10-round
  headline: does the policy stay non-degenerate).

Each run is validated (``rlk-validate``; ``--require-bitwise`` for R/R) and summarised in ``filtered_gpu.json`` /
``filtered_gpu.md`` (compared tokens, mismatches, mean / max |diff|, kept-set sizes, rollout / train tok/s).

    python3 benchmarks/frameworks/filtered_gpu.py --out $OUT [--rounds 5] [--pp-rounds 2] [--only rr-t1,...] [--lr X]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_gpu import _dump, _newest_run, _stage, _summary, setup

SEEDS_FILTERS = ["--top-p", "0.95", "--top-k", "40"]
RUNS = {  # name -> (mode, options, rounds: None = --rounds / --pp-rounds)
    "rr-t1": ("consistency", [*SEEDS_FILTERS, "--temperature", "1.0"], None),
    "rr-t07": ("consistency", [*SEEDS_FILTERS, "--min-p", "0.05", "--temperature", "0.7"], None),
    "pp-semantic": ("native", [*SEEDS_FILTERS, "--min-p", "0.05", "--temperature", "0.7",
                               "--train-logprobs", "unfiltered"], None),
    "pp-processed": ("native", [*SEEDS_FILTERS, "--min-p", "0.05", "--temperature", "0.7"], None),
    "pp-top-p-1": ("native", ["--top-p", "1.0", "--temperature", "0.7"], None),
    "rr-ten": ("consistency", ["--top-p", "1.0", "--temperature", "0.9"], 10),
}


def _validate(run: Path, bitwise: bool, env: dict, doc_path: Path) -> dict:
    cmd = [sys.executable, "-m", "rlk_validate", str(run), "--json", str(doc_path)]
    cmd += ["--require-bitwise"] if bitwise else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out: dict = {"rc": proc.returncode}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        doc = json.loads(doc_path.read_text())
        out["verdict"] = doc.get("verdict")
        out["findings"] = [f"{f['severity']} {f['code']}: {f['message'][:300]}" for f in doc.get("findings", [])
                           if f["severity"] in ("error", "warning", "info")]
    return out


def _kept(run: Path) -> dict:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    stats = [r["kept_set"] for r in rows if isinstance(r.get("kept_set"), dict)]
    n = sum(s["tokens"] for s in stats)
    if not n:
        return {}
    return {"tokens": n, "mean": round(sum(s["mean"] * s["tokens"] for s in stats) / n, 3),
            "singletons": round(sum(s["singletons"] * s["tokens"] for s in stats) / n, 4),
            "p99_max": max(s["p99"] for s in stats), "medians": [s["median"] for s in stats]}


def _markdown(res: dict) -> str:
    lines = [f"# filtered sampling, frameworks loop ({res['meta'].get('gpu', '?')})", "",
             f"commit {res['meta'].get('RLK_COMMIT')}, {res.get('elapsed_s')} s", "",
             "| run | settings | rounds | compared | mismatches | mean abs diff | max abs diff | kept mean | "
             "singletons | rollout tok/s | train tok/s | verdict |", "|" + " --- |" * 12]
    for name, r in res["runs"].items():
        k = r.get("kept", {})
        lines.append(f"| {name} | {' '.join(RUNS[name][1])} | {r.get('rounds')} | {r.get('compared_tokens')} | "
                     f"{r.get('mismatches')} | {r.get('mean_abs_diff')} | {r.get('max_abs_diff')} | "
                     f"{k.get('mean')} | {k.get('singletons')} | {r.get('rollout_tok_s_median_after_first')} | "
                     f"{r.get('train_tok_s_median_after_first')} | {r.get('validation', {}).get('verdict')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--pp-rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=4242)
    p.add_argument("--lr", type=float, default=None, help="every run's --lr (default: the engine's, scaled to width)")
    p.add_argument("--only", default=",".join(n for n in RUNS if n != "rr-ten"))
    p.add_argument("--budget-s", type=float, default=540, help="all runs together: each gets what is left / runs left")
    a = p.parse_args(argv)
    out, runs, env, res = setup(a)
    t0 = time.monotonic()
    names = a.only.split(",")
    for i, name in enumerate(names):
        mode, extra, rounds = RUNS[name]
        rounds = rounds or (a.rounds if mode == "consistency" else a.pp_rounds)
        cmd = [sys.executable, "-m", "rlk_repro", "run", "--engine", "frameworks", "--mode", mode, "--model", a.model,
               "--rounds", str(rounds), "--prompts-per-round", str(a.prompts), "--samples-per-prompt", str(a.samples),
               "--max-new-tokens", str(a.max_new_tokens), "--gpu-memory-utilization", str(a.gpu_mem),
               "--seed", str(a.seed), "--output", str(runs), "--run-name", name, *extra,
               *(["--lr", repr(a.lr)] if a.lr is not None else [])]
        before = {q.name for q in runs.iterdir()}
        cap = (a.budget_s - (time.monotonic() - t0)) / (len(names) - i)
        res["stages"][name] = _stage(name, cmd, env, max(cap, 30.0), out)
        run = _newest_run(runs, before)
        if run is not None:
            with contextlib.suppress(Exception):
                res["runs"][name] = {**_summary(run), "kept": _kept(run),
                                     "validation": _validate(run, mode == "consistency", env,
                                                             out / "logs" / f"{name}-validation.json")}
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        _dump(out / "filtered_gpu.json", res)
        (out / "filtered_gpu.md").write_text(_markdown(res))
    print((out / "filtered_gpu.md").read_text())
    return 0 if all(s.get("rc") == 0 for s in res["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
