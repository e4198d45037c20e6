#!/usr/bin/env python3
"""The frameworks loop with a Qwen3-MoE model on one H200 (issue 36): ``rlk-repro run --engine frameworks`` R/R
(``--mode consistency``: rlk's MoE in vLLM's ``FusedMoE`` and in Megatron's MoE layer spec) and P/P (``--mode
native``: vLLM's own fused MoE, Megatron's stock ``MoELayer`` + ``SequentialMLP``), the same seeds, weights updated
every round; then ``rlk-validate RUN --require-bitwise --json`` on each run directory. Recorded per run: compared
tokens, log-prob mismatches, max |diff|, the K3 estimate of KL(rollout || train) over the sampled tokens (mean of
``r - 1 - log r``, ``r = p_train / p_rollout``), the routing diagnostic (tokens whose expert set differs between vLLM
and Megatron at any layer), throughput. Expected: R/R 0 mismatches, 0 routing differences, validation passed; P/P
mismatches > 0 and ``BITWISE_MISMATCH``.

    PYTHONPATH=/tmp/site:/tmp/mcore:packages/...  python3 benchmarks/frameworks/moe_loop_gpu.py --out $OUT \\
        [--model qwen3-moe-30b-a3b-L2] [--rounds 5] [--prompts 64] [--samples 8] [--max-new-tokens 80]

Writes ``$OUT/moe_loop.json`` / ``moe_loop.md`` (rewritten after every stage), the run directories under
``$OUT/runs``, each validation as ``$OUT/<rr|pp>-validation.json``, the logs under ``$OUT/logs``. Exit 1 if a stage
failed or R/R is not bitwise (0 mismatches, 0 routing differences, validation passed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from loop_gpu import _dump, _metrics, _newest_run, _run_cmd, _stage, _summary, setup  # noqa: E402


def k3_kl(run: Path) -> dict:
    """The K3 KL estimate over every compared token of ``run`` (its train-data files), and the token count."""
    import torch
    from safetensors.torch import load_file

    total, n = 0.0, 0
    for f in sorted((run / "train-data").glob("*.safetensors")):
        t = load_file(str(f))
        m = t["response_mask"]
        d = (t["train_logprobs"][m] - t["rollout_logprobs"][m]).double()  # log r
        total += float((torch.expm1(d) - d).sum())
        n += int(m.sum())
    return {"k3_kl_mean": total / n if n else None, "k3_tokens": n}


def routing(run: Path) -> dict:
    rows = _metrics(run)
    routed = [r for r in rows if "routing_compared_tokens" in r]
    n = sum(r["routing_compared_tokens"] for r in routed)
    m = sum(r["routing_mismatch_tokens"] for r in routed)
    return {"routing_compared_tokens": n, "routing_mismatch_tokens": m,
            "routing_mismatch_fraction": m / n if n else None, "routing_rounds": len(routed)}


def _markdown(res: dict) -> str:
    lines = [f"# Qwen3-MoE frameworks loop ({res['settings']['model']}) on {res['meta'].get('gpu', '?')}", "",
             f"commit {res['meta'].get('RLK_COMMIT')}, {res.get('elapsed_s')} s", "",
             "| stage | rc | s | note |", "| --- | --- | --- | --- |"]
    for n, s in res["stages"].items():
        lines.append(f"| {n} | {s.get('rc')} | {s.get('seconds')} | {s.get('error', '')[:150]} |")
    lines += ["", "| run | rounds | compared | mismatches | max diff | K3 KL | routing differs | validation | "
              "rollout tok/s | train tok/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, s in res["runs"].items():
        kl = s.get("k3_kl_mean")
        lines.append(f"| {n} | {s['rounds']} | {s['compared_tokens']} | {s['mismatches']} | {s['max_abs_diff']} | "
                     f"{'-' if kl is None else f'{kl:.3g}'} | {s['routing_mismatch_tokens']} of "
                     f"{s['routing_compared_tokens']} | {s.get('validation')} | "
                     f"{s['rollout_tok_s_median_after_first']} | {s['train_tok_s_median_after_first']} |")
    lines.append(f"\nR/R bitwise (0 mismatches, 0 routing differences, validation passed): {res.get('rr_bitwise')}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-moe-30b-a3b-L2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--native-rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=80, help="limits vary in [max/2, max] per prompt")
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rr-cap-s", type=float, default=300)
    p.add_argument("--pp-cap-s", type=float, default=200)
    a = p.parse_args(argv)
    a.tp = 1
    out, runs, env, res = setup(a)
    t0 = time.monotonic()

    def save():
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        _dump(out / "moe_loop.json", res)
        (out / "moe_loop.md").write_text(_markdown(res))

    for name, mode, rounds, cap in (("rr", "consistency", a.rounds, a.rr_cap_s),
                                    ("pp", "native", a.native_rounds, a.pp_cap_s)):
        before = {q.name for q in runs.iterdir()}
        res["stages"][name] = _stage(name, _run_cmd(a, mode, rounds, runs), env, cap, out)
        run = _newest_run(runs, before)
        if run is not None and (run / "metrics.jsonl").is_file():
            summary = {**_summary(run), **routing(run)}
            try:
                summary.update(k3_kl(run))
            except Exception as exc:  # recorded, not fatal: the validation below is the verdict
                summary["k3_error"] = f"{type(exc).__name__}: {exc}"
            report = out / f"{name}-validation.json"
            val = _stage(f"{name}-validate", [sys.executable, "-m", "rlk_validate", str(run), "--require-bitwise",
                                              "--json", str(report)], env, 60, out)
            res["stages"][f"{name}-validate"] = val
            if report.is_file():
                doc = json.loads(report.read_text())
                summary["validation"] = doc.get("verdict")
                summary["validation_codes"] = sorted({f["code"] for f in doc.get("findings", [])})
            res["runs"][name] = summary
        save()
    rr = res["runs"].get("rr", {})
    res["rr_bitwise"] = bool(rr) and rr["mismatches"] == 0 and rr["routing_mismatch_tokens"] == 0 \
        and rr["routing_compared_tokens"] > 0 and rr.get("validation") == "passed" and \
        rr.get("weights_changed_every_round") is True
    ran = all(res["stages"].get(n, {}).get("rc") == 0 for n in ("rr", "pp"))
    save()
    kl = res["runs"].get("pp", {}).get("k3_kl_mean")
    print(json.dumps({"rr_bitwise": res["rr_bitwise"], "stages_ran": ran,
                      "rr_compared": rr.get("compared_tokens"),
                      "pp_mismatches": res["runs"].get("pp", {}).get("mismatches"),
                      "pp_k3_kl": None if kl is None or math.isnan(kl) else kl}, indent=1))
    return 0 if res["rr_bitwise"] and ran else 1


if __name__ == "__main__":
    sys.exit(main())
