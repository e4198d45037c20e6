#!/usr/bin/env python3
"""The frameworks loop with Megatron at emulated TP 4 on one H200 (issue 35): ``rlk-repro run --engine frameworks
--mode consistency --train-tp 4 --rollout-tp 1 --emulate-train-tp --sequence-parallel --tp-invariant 8`` — vLLM at TP 1
and Megatron built at TP 1 running the arithmetic of every rank of TP 4 with sequence parallelism
(``RL_KERNEL_TP_EMULATE=4,sp``: each rank's shard with its own launches and shapes, the fp32 partials merged in process
by the collectives' rank tree), both sides in TP-invariant mode (``rlk.gemm.tp.v1``, G = 8), weights synced every
round; then ``rlk-validate RUN --require-bitwise --json``. The negative control: the same with ``--emulate-train-tp
bi-control`` (the row-parallel linears split as ``rlk.gemm.bi.v1``, what real TP 4 computes without invariant mode).
Expected: R/R 0 mismatches over >= 100,000 compared tokens, the weights changed every round, validation passed, the
manifest naming the emulation (``parallel.train_tp_emulated``); the control's mismatches > 0.

    PYTHONPATH=/tmp/site:/tmp/mcore:packages/...  python3 benchmarks/frameworks/tp_emu_loop_gpu.py --out $OUT \\
        [--rounds 6] [--prompts 64] [--samples 8] [--max-new-tokens 80] [--rr-cap-s 330] [--bi-cap-s 110]

What it proves: every rank's arithmetic of TP 4 (with SP) against vLLM TP 1, in the loop, with weight updates. What it
does not: the transport and the multi-process layout (docs/ops/linear_tp.md, "Emulated TP on one GPU").

Writes ``$OUT/tp_emu_loop.json`` / ``tp_emu_loop.md``, the run directories under ``$OUT/runs``, the validation as
``$OUT/rr-validation.json``, the logs under ``$OUT/logs``. Exit 1 if a stage failed or R/R is not bitwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from loop_gpu import _dump, _newest_run, _stage, _summary, setup  # noqa: E402

MIN_TOKENS = 100_000
TRAIN_TP = 4


def run_cmd(a, control: bool, rounds: int, runs: Path) -> list[str]:
    """The ``rlk-repro run`` of one stage: R/R (``--mode consistency``) at emulated train TP 4 with SP."""
    return [sys.executable, "-m", "rlk_repro", "run", "--engine", "frameworks", "--mode", "consistency",
            "--model", a.model, "--rounds", str(rounds), "--prompts-per-round", str(a.prompts),
            "--samples-per-prompt", str(a.samples), "--max-new-tokens", str(a.max_new_tokens),
            "--gpu-memory-utilization", str(a.gpu_mem), "--output", str(runs), "--seed", str(a.seed), "--debug",
            "--train-tp", str(TRAIN_TP), "--rollout-tp", "1", "--tp-invariant", "8", "--sequence-parallel",
            "--emulate-train-tp", "bi-control" if control else "on"]


def _markdown(res: dict) -> str:
    lines = [f"# Frameworks loop, Megatron at emulated TP {TRAIN_TP} + SP, vLLM TP 1 ({res['settings']['model']}) on "
             f"{res['meta'].get('gpu', '?')}", "", f"commit {res['meta'].get('RLK_COMMIT')}, {res.get('elapsed_s')} s",
             "", "| stage | rc | s | note |", "| --- | --- | --- | --- |"]
    for n, s in res["stages"].items():
        lines.append(f"| {n} | {s.get('rc')} | {s.get('seconds')} | {s.get('error', '')[:150]} |")
    lines += ["", "| run | rounds | compared | mismatches | max diff | weights changed every round | validation | "
              "emulated | rollout tok/s | train tok/s |", "|" + " --- |" * 10]
    for n, s in res["runs"].items():
        lines.append(f"| {n} | {s['rounds']} | {s['compared_tokens']} | {s['mismatches']} | {s['max_abs_diff']} | "
                     f"{s.get('weights_changed_every_round')} | {s.get('validation')} | {s.get('emulated')} | "
                     f"{s['rollout_tok_s_median_after_first']} | {s['train_tok_s_median_after_first']} |")
    lines.append(f"\nR/R bitwise (0 mismatches over >= {MIN_TOKENS} tokens, validation passed): {res.get('rr_bitwise')}"
                 f"; negative control differs: {res.get('control_differs')}")
    lines.append("\nEmulation proves the arithmetic of every rank (shards, launches, shapes, the merge's rank tree); "
                 "not the transport or the multi-process layout.")
    return "\n".join(lines) + "\n"


def _emulated(run: Path) -> dict | None:
    manifest = run / "manifest.json"
    return json.loads(manifest.read_text()).get("parallel", {}).get("train_tp_emulated") if manifest.is_file() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--control-rounds", type=int, default=1)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=80, help="limits vary in [max/2, max] per prompt")
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rr-cap-s", type=float, default=330)
    p.add_argument("--bi-cap-s", type=float, default=110)
    p.add_argument("--dry-run", action="store_true", help="print the two stages' commands and exit")
    a = p.parse_args(argv)
    if a.dry_run:
        for control in (False, True):
            print(" ".join(run_cmd(a, control, a.control_rounds if control else a.rounds, Path(a.out) / "runs")))
        return 0
    out, runs, env, res = setup(a)
    t0 = time.monotonic()

    def save():
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        _dump(out / "tp_emu_loop.json", res)
        (out / "tp_emu_loop.md").write_text(_markdown(res))

    for name, control, rounds, cap in (("rr", False, a.rounds, a.rr_cap_s), ("bi", True, a.control_rounds, a.bi_cap_s)):
        before = {q.name for q in runs.iterdir()}
        res["stages"][name] = _stage(name, run_cmd(a, control, rounds, runs), env, cap, out)
        run = _newest_run(runs, before)
        if run is not None and (run / "metrics.jsonl").is_file():
            summary = {**_summary(run), "emulated": _emulated(run)}
            if not control:
                report = out / "rr-validation.json"
                val = _stage("rr-validate", [sys.executable, "-m", "rlk_validate", str(run), "--require-bitwise",
                                             "--json", str(report)], env, 60, out)
                res["stages"]["rr-validate"] = val
                if report.is_file():
                    doc = json.loads(report.read_text())
                    summary["validation"] = doc.get("verdict")
                    summary["validation_codes"] = sorted({f["code"] for f in doc.get("findings", [])})
            res["runs"][name] = summary
        save()
    rr, bi = res["runs"].get("rr", {}), res["runs"].get("bi", {})
    emu = rr.get("emulated") or {}
    res["rr_bitwise"] = bool(rr) and rr["mismatches"] == 0 and rr["compared_tokens"] >= MIN_TOKENS \
        and rr.get("validation") == "passed" and rr.get("weights_changed_every_round") is True \
        and emu.get("tp") == TRAIN_TP and emu.get("sequence_parallel") is True
    res["control_differs"] = bool(bi) and bi["mismatches"] > 0 and (bi.get("emulated") or {}).get("negative_control")
    ran = res["stages"].get("rr", {}).get("rc") == 0
    save()
    print(json.dumps({"rr_bitwise": res["rr_bitwise"], "rr_compared": rr.get("compared_tokens"),
                      "rr_mismatches": rr.get("mismatches"), "control_mismatches": bi.get("mismatches"),
                      "control_differs": res["control_differs"]}, indent=1))
    return 0 if res["rr_bitwise"] and res["control_differs"] and ran else 1


if __name__ == "__main__":
    sys.exit(main())
