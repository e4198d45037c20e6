#!/usr/bin/env python3
"""The mismatch-knob ladder on the frameworks engine on one H200 (issue 38), the Qwen3-0.6B shape, in one budget:
first the FP8 re-quantization against vLLM's CUDA kernel (``tests/gpu/test_fp8_requant_gpu.py``), then ``rlk-repro
ladder --engine frameworks`` (six default rungs, the FP8 ones included, each its own ``rlk-repro run`` process;
``--rungs all`` for the eight; few rounds, a small batch, vLLM eager so the engine start-ups fit), then
``rlk-validate ladder`` on its root.

    PYTHONPATH=/tmp/site:/tmp/mcore:packages/rlk-core/src:packages/rlk-validate/src:packages/rlk-collectives/src:\
packages/rlk-vllm-plugin/src:packages/rlk-megatron-provider/src:packages/rlk-repro/src \
    python3 benchmarks/frameworks/ladder_gpu.py --out $OUT --budget-s 420

Run again with the same ``--out`` (the sitting's stage on a warm machine), it finishes the ladder found there
(``rlk-repro ladder --resume``: rungs that finished are kept, one cut by the budget runs afresh). Leaves
``ladder/ladder-<id>/`` (the root: rungs, skip records, ``ladder-report.json/.md``, ``report/`` figures),
``ladder-validate.txt`` / ``ladder-validate.json`` (``rlk-validate ladder``), ``logs/`` and ``ladder_gpu.json`` /
``ladder_gpu.md`` (per rung: status, drift class, mean and max |dlogp|, mismatches, rollout tokens/s; the FP8 rungs'
weight syncs: layers re-quantized and checked against vLLM's kernel). Exit 1 if a stage failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_gpu import ROOT, _dump, _stage, setup  # one stage runner, one plugin dist-info writer

#: the rungs a sitting runs by default: the FP8 rungs, what they are compared with, and the R/R control
DEFAULT_RUNGS = "0-aligned,1-fp8,2-top-p,3-top-k,4-fp8-filters,rr-0-aligned"


def _rung_summary(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run / "metrics.jsonl").is_file() else []
    man = json.loads((run / "manifest.json").read_text()) if (run / "manifest.json").is_file() else {}
    rt = man.get("runtime", {})
    tok = [r.get("rollout_tokens_per_s") for r in rows if r.get("rollout_tokens_per_s")]
    return {"rounds": len(rows), "rollout_quantization": man.get("rollout_quantization"),
            "rollout_tok_s_median": statistics.median(tok) if tok else None,
            "vllm_parameters_changed": [r.get("vllm_parameters_changed") for r in rows],
            "initial_weight_sync": rt.get("initial_weight_sync"), "fp8": rt.get("vllm", {}).get("fp8"),
            "v2_model_runner": rt.get("vllm", {}).get("v2_model_runner")}


def _markdown(res: dict) -> str:
    lines = ["# ladder on the frameworks engine (H200)", "", f"settings: `{json.dumps(res['settings'])}`", "",
             "| stage | rc | seconds |", "|---|---|---|"]
    lines += [f"| {k} | {v.get('rc')} | {v.get('seconds')} |" for k, v in res["stages"].items()]
    lines += ["", "| rung | status | class | mean abs dlogp | max abs dlogp | mismatches | rollout tok/s | quant |",
              "|---|---|---|---|---|---|---|---|"]
    for g in res.get("rungs", []):
        m = g.get("metrics") or {}
        d = m.get("dlogp") or {}
        lines.append(f"| {g['name']} | {g['status']} | {(g.get('classification') or {}).get('class')} | "
                     f"{d.get('abs_mean')} | {d.get('abs_max')} | {m.get('mismatch_count')} | "
                     f"{(g.get('run') or {}).get('rollout_tok_s_median')} | "
                     f"{(g.get('run') or {}).get('rollout_quantization')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--rungs", default=DEFAULT_RUNGS,
                   help=f"default rungs to run ({DEFAULT_RUNGS}: six engine start-ups fit the budget; 'all': the eight "
                   "default rungs, ~50 s each eager)")
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    t0 = time.monotonic()
    out, _, env, res = setup(a)

    def left() -> float:
        return a.budget_s - (time.monotonic() - t0)

    def save():
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        _dump(out / "ladder_gpu.json", res)
        (out / "ladder_gpu.md").write_text(_markdown(res))

    env = {**env, "RLK_REQUIRE_GPU": "1"}
    parent = out / "ladder"
    parent.mkdir(exist_ok=True)
    earlier = sorted(q for q in parent.iterdir() if q.is_dir())
    if earlier:  # a second call of the stage on a warm machine: finish that ladder (its finished rungs are kept)
        res["resumed"] = earlier[-1].name
        for name in ("ladder_gpu.json", "ladder_gpu.md"):  # the first call's record stays beside this one's
            if (out / name).is_file():
                (out / name).rename(out / name.replace("ladder_gpu", f"ladder_gpu-{int(time.time())}"))
        cmd = [sys.executable, "-m", "rlk_repro", "ladder", "--resume", str(earlier[-1])]
    else:
        res["stages"]["fp8-requant"] = _stage("fp8-requant", [sys.executable, "-m", "pytest", "-q", "-p",
                                                              "no:cacheprovider", "-rA",
                                                              str(ROOT / "tests/gpu/test_fp8_requant_gpu.py")],
                                              env, min(90.0, left() - 60), out)
        save()
        cmd = [sys.executable, "-m", "rlk_repro", "ladder", "--engine", "frameworks", "--model", a.model,
               "--rounds", str(a.rounds), "--prompts-per-round", str(a.prompts), "--samples-per-prompt",
               str(a.samples), "--max-new-tokens", str(a.max_new_tokens), "--gpu-memory-utilization", str(a.gpu_mem),
               "--enforce-eager", "--seed", str(a.seed), "--output", str(parent),
               *(["--rungs", a.rungs] if a.rungs != "all" else [])]
    res["stages"]["ladder"] = _stage("ladder", cmd, env, max(30.0, left() - 25), out)
    save()
    roots = sorted(q for q in parent.iterdir() if q.is_dir())
    if roots:
        root = roots[-1]
        res["ladder_root"] = str(root.relative_to(out))
        v = _stage("validate", [sys.executable, "-m", "rlk_validate", "ladder", str(root), "--json",
                                str(out / "ladder-validate.json")], env, max(20.0, min(60.0, left() - 5)), out)
        res["stages"]["validate"] = v
        (out / "ladder-validate.txt").write_text((out / "logs" / "validate.log").read_text(errors="replace"))
        if (out / "ladder-validate.json").is_file():
            doc = json.loads((out / "ladder-validate.json").read_text())
            res["verdict"] = doc.get("verdict")
            res["rungs"] = doc.get("rungs", [])
            for g in res["rungs"]:
                if g.get("dir") and (root / g["dir"]).is_dir():
                    g["run"] = _rung_summary(root / g["dir"])
    save()
    print((out / "ladder_gpu.md").read_text())
    ok = all(s.get("rc") == 0 for k, s in res["stages"].items() if k != "validate")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
