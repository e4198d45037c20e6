"""The local consistency engine on one GPU: R/R and P/P on the same seeds, mismatches and throughput.

Runs ``rlk-repro run`` twice (``--mode consistency`` = all R/R, ``--mode native`` = all P/P) as
subprocesses with identical settings, validates each run directory with ``rlk-validate``, and writes
``local_engine.json`` / ``local_engine.md`` (GPU, driver, versions, commit) with, per mode: compared
tokens, mismatches, max |diff|, and rollout / training throughput. Throughput is summed over the
rounds after the first (round 0 includes Triton compilation and cuBLAS/cuDNN warm-up) and also over all
rounds; the ratio is R/R tokens/s over P/P tokens/s, per phase.

    RLK_COMMIT=$(git rev-parse HEAD) python benchmarks/bench_local_engine.py --rounds 10
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

import _common  # noqa: F401  (puts rlk-core on sys.path)
from harness import copy_bandwidth, default_out_dir, environment, require_cuda, write_results

ROOT = Path(__file__).resolve().parents[1]
SRC = [ROOT / "packages" / p / "src" for p in ("rlk-core", "rlk-repro", "rlk-validate")]
sys.path[:0] = [str(p) for p in SRC if str(p) not in sys.path]  # rlk_repro.report, also without an install


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(p) for p in SRC] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "rlk_repro", "run", "--engine", "local", "--mode", mode, "--device", args.device,
           "--model", args.model, "--rounds", str(args.rounds), "--prompts-per-round", str(args.prompts),
           "--samples-per-prompt", str(args.samples), "--max-new-tokens", str(args.max_new_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--chunk-size", str(args.chunk_size),
           "--page-size", str(args.page_size), "--seed", str(args.seed), "--output", str(out / mode)]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    tail = proc.stdout[-4000:]
    print(tail, flush=True)
    dirs = sorted((out / mode).glob("*/manifest.json"))
    result: dict = {"mode": mode, "exit_code": proc.returncode, "wall_s": wall}
    if not dirs:
        result["error"] = "no run directory was written"
        return result
    run_dir = dirs[-1].parent
    result["run_dir"] = str(run_dir)
    report = run_dir.parent / f"{run_dir.name}-validation.json"
    vcmd = [sys.executable, "-m", "rlk_validate", str(run_dir), "--json", str(report), "-q"]
    if mode == "consistency":
        vcmd.append("--require-bitwise")
    val = subprocess.run(vcmd, env=_env(), cwd=ROOT, capture_output=True, text=True)
    print(val.stdout.strip(), val.stderr.strip(), flush=True)
    keep = Path(default_out_dir()) / "local-engine-runs" / mode  # the summary files, not the tensors
    keep.mkdir(parents=True, exist_ok=True)
    for rel in ("manifest.json", "metrics.jsonl", "bitwise-validation.json", "report/summary.md", "exit-code"):
        if (run_dir / rel).is_file():
            shutil.copy(run_dir / rel, keep / Path(rel).name)
    if report.is_file():
        shutil.copy(report, keep / "rlk-validate.json")
    result.update(summarize(keep))
    result["validate_exit"] = val.returncode
    return result


def summarize(keep: Path) -> dict:
    """The row of one mode from its kept summary files (metrics.jsonl, bitwise-validation.json,
    rlk-validate.json, manifest.json); the pooled throughput is rlk-repro report's."""
    from rlk_repro.report import load_run, pooled_rate
    from rlk_repro.report import summarize as summarize_metrics

    run = load_run(keep)
    metrics, manifest, pooled = run.rows, run.manifest, summarize_metrics(run)
    steady = metrics[1:] or metrics
    bitwise = json.loads((keep / "bitwise-validation.json").read_text())
    try:
        rep = json.loads((keep / "rlk-validate.json").read_text())
        verdict = rep["verdict"]
        findings = [f"{f.get('code')}: {f.get('message', '')[:160]}" for f in rep.get("findings", [])
                    if f.get("severity") in ("error", "incomplete", "warning")]
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        verdict, findings = f"no report ({type(exc).__name__})", []
    return {
        "mode": manifest["mode"], "plan": manifest["plan"], "run_id": manifest["run_id"],
        "commit": (manifest.get("repos") or [{}])[0].get("sha"), "rounds": len(metrics),
        "compared_tokens": bitwise.get("element_count"), "mismatch_count": bitwise.get("mismatch_count"),
        "max_abs_diff": bitwise.get("max_abs_diff"),
        "weights_changed_every_round": all(r["weights_changed"] for r in metrics),
        "validate_verdict": verdict, "validate_findings": findings,
        "rollout_tok_s": pooled["rollout_tokens_per_s"],
        "rollout_gen_tok_s": pooled_rate(steady, "rollout", "response_tokens"),
        "train_tok_s": pooled["train_tokens_per_s"],
        "rollout_tok_s_all": pooled_rate(metrics, "rollout"),
        "train_tok_s_all": pooled_rate(metrics, "train"),
        "peak_memory_gib": max(r["peak_memory_bytes"] or 0 for r in metrics) / 2**30,
        "chunked_prompts": sum(r["chunked_prompts"] for r in metrics),
        "batch_composition_changes": sum(r["batch_composition_changes"] for r in metrics),
        "rollout_seconds": sum(r["rollout_seconds"] for r in metrics),
        "train_seconds": sum(r["train_seconds"] for r in metrics),
        "per_round": per_round(metrics),
        **{f"{phase}_stability": stability(metrics, phase) for phase in ("rollout", "train")},
    }


def per_round(metrics: list[dict]) -> list[dict]:
    """Each round's seconds, tokens/s and Triton JIT compiles (compiled / loaded from Triton's cache) per phase."""
    from rlk_repro.jitwatch import counts as jit_counts

    rows = []
    for r in metrics:
        row = {"round": r["round"]}
        for phase in ("rollout", "train"):
            row[f"{phase}_s"] = r[f"{phase}_seconds"]
            row[f"{phase}_tok_s"] = r[f"{phase}_tokens_per_s"]
            if "triton_jit" in r:  # (rows of runs before rlk_repro.jitwatch have no record)
                row[f"{phase}_jit"] = jit_counts(r["triton_jit"], phase)
            if "python_gc" in r:  # (nor of the GC record before it)
                g = r["python_gc"].get(phase) or {}
                row[f"{phase}_gc"] = (g.get("collections", 0), g.get("seconds", 0.0), g.get("max_s", 0.0))
        steps = r.get("rollout_step_ms") or {}
        if steps:
            row["rollout_steps_ms"] = (steps["median"], steps["max"], steps["slowest"])
            if "launch_median" in steps:  # (rows before the split have none)
                row["rollout_step_split_ms"] = (steps["launch_median"], steps["rest_median"])
        rows.append(row)
    return rows


def stability(metrics: list[dict], phase: str) -> dict:
    """Issue 21's JIT-dip criterion for one phase: every round after round 0 at >= 0.9x of the median tokens/s of
    those rounds (``slowest_vs_median``); round 0 (CUDA / cuBLAS warm-up in every mode, plus whatever compiles)
    reported beside it against the same median."""
    rates = [r[f"{phase}_tokens_per_s"] for r in metrics]
    if len(rates) < 2:
        return {}
    median, slowest = statistics.median(rates[1:]), min(rates[1:])
    return {"median_tok_s": median, "slowest_vs_median": slowest / median,
            "slowest_round": 1 + rates[1:].index(slowest), "round0_vs_median": rates[0] / median,
            "rounds_below_0.9x": [i for i, v in enumerate(rates) if i and v < 0.9 * median]}


def write_summary(rows: list[dict], env: dict, copy: dict, args: dict) -> dict:
    by = {r["mode"]: r for r in rows}
    ratios = {}
    if "rollout_tok_s" in by.get("consistency", {}) and "rollout_tok_s" in by.get("native", {}):
        c, n = by["consistency"], by["native"]
        ratios = {"rollout": c["rollout_tok_s"] / n["rollout_tok_s"], "train": c["train_tok_s"] / n["train_tok_s"]}
    meta = {"env": env, "copy": copy, "args": args, "ratios_rr_over_pp": ratios,
            "throughput": "tokens / seconds pooled over rounds 1..N-1 (round 0 compiles kernels); *_all: all rounds"}
    write_results(default_out_dir(), "local_engine", meta, rows,
                  [("mode", "mode"), ("rounds", "rounds"), ("compared_tokens", "compared tokens"),
                   ("mismatch_count", "mismatches"), ("max_abs_diff", "max abs diff"),
                   ("validate_verdict", "rlk-validate"), ("rollout_tok_s", "rollout tok/s"),
                   ("train_tok_s", "train tok/s"), ("peak_memory_gib", "peak GiB")])
    md = Path(default_out_dir()) / "local_engine.md"
    md.write_text(md.read_text() + per_round_markdown(rows))
    return ratios


def per_round_markdown(rows: list[dict]) -> str:
    """The per-round tables and the JIT-dip criterion of each mode (appended to local_engine.md)."""
    out = ["", "Throughput is tokens / seconds pooled over the rounds after round 0 (round 0: CUDA and cuBLAS "
           "warm-up, and whatever kernels compile).", ""]
    for r in rows:
        if "per_round" not in r:
            continue
        out += [f"## {r['mode']}: per round", ""]
        for phase in ("rollout", "train"):
            st = r.get(f"{phase}_stability") or {}
            if st:
                out.append(f"- {phase}: slowest round after round 0 (round {st['slowest_round']}) at "
                           f"{st['slowest_vs_median']:.2f}x of their median ({st['median_tok_s']:.4g} tok/s); "
                           f"rounds below 0.9x: {st['rounds_below_0.9x'] or 'none'}; round 0 at "
                           f"{st['round0_vs_median']:.2f}x")
        out += ["", "| round | rollout s | rollout tok/s | rollout JIT (compiled / loaded) | rollout step ms "
                "(median / max) | of it: host launch / rest (medians) | rollout GC (collections, s, longest s) "
                "| train s | train tok/s | train JIT (compiled / loaded) | train GC |", "|---" * 11 + "|"]
        slow = []
        for p in r["per_round"]:
            jit = {ph: "{} / {}".format(*p[f"{ph}_jit"]) if f"{ph}_jit" in p else "not recorded"
                   for ph in ("rollout", "train")}
            gc = {ph: "{}, {:.3f}, {:.3f}".format(*p[f"{ph}_gc"]) if f"{ph}_gc" in p else "not recorded"
                  for ph in ("rollout", "train")}
            steps = "{:.1f} / {:.1f}".format(*p["rollout_steps_ms"][:2]) if "rollout_steps_ms" in p else "not recorded"
            split = ("{:.1f} / {:.1f}".format(*p["rollout_step_split_ms"]) if "rollout_step_split_ms" in p
                     else "not recorded")
            out.append(f"| {p['round']} | {p['rollout_s']:.2f} | {p['rollout_tok_s']:.4g} | {jit['rollout']} | "
                       f"{steps} | {split} | {gc['rollout']} | {p['train_s']:.2f} | {p['train_tok_s']:.4g} | "
                       f"{jit['train']} | {gc['train']} |")
            if "rollout_steps_ms" in p:
                slow.append(f"round {p['round']}: " + ", ".join(f"step {i} {ms:.1f} ms ({t} tokens)"
                                                                 for i, ms, t in p["rollout_steps_ms"][2]))
        if slow:
            out += ["", "Slowest rollout steps per round:", "", *(f"- {line}" for line in slow)]
        out.append("")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prompts", type=int, default=16, help="prompts (GRPO groups) per round")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--modes", default="consistency,native")
    p.add_argument("--device", default="cuda")
    p.add_argument("--summarize", nargs="+", metavar="KEPT_DIR",
                   help="only rebuild local_engine.json/.md from kept run summaries (no GPU needed)")
    p.add_argument("--env-from", metavar="JSON", help="with --summarize: a local_engine.json whose meta.env to use")
    p.add_argument("--work", default="/tmp/rlk-local-engine", help="where the run directories go")
    args = p.parse_args()

    if args.summarize:  # rebuild the table from kept run summaries (e.g. modes run in separate calls)
        meta = json.loads(Path(args.env_from).read_text())["meta"]
        rows = [summarize(Path(d)) for d in args.summarize]
        ratios = write_summary(rows, meta["env"], meta["copy"], {"summarized": args.summarize})
        print(json.dumps({"ratios_rr_over_pp": ratios}), flush=True)
        return 0
    require_cuda("bench_local_engine")  # the run's environment and copy bandwidth are the GPU's
    env, copy = environment(), copy_bandwidth()
    work = Path(args.work)
    rows = [run_mode(mode, args, work) for mode in args.modes.split(",")]
    ratios = write_summary(rows, env, copy, vars(args))
    print(json.dumps({"ratios_rr_over_pp": ratios}), flush=True)
    by = {r["mode"]: r for r in rows}
    cons = by.get("consistency", {})
    return 0 if cons.get("exit_code") == 0 and cons.get("mismatch_count") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
