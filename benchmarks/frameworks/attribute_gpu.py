#!/usr/bin/env python3
"""Attribution of the ladder's frameworks rungs on one H200 (issue 38): ``rlk-repro attribute`` on the FP8 rung
(``1-fp8``), the top-p rung (``2-top-p``), the near-aligned baseline they are read against (``0-aligned``) and the R/R
control (``rr-0-aligned``, plain: no boundary; and with one ulp injected at ``train:1:ffn.down``: exactly that point),
each a replay of the rung's round 0 on real vLLM (eager, forward hooks) and real megatron-core.

The rungs come from the ``ladder`` stage's root (``--ladder /tmp/sit/ladder``: its newest ``ladder/ladder-*``); where
there is none, a small ladder of those rungs runs first (one round, ``--prompts`` x ``--samples``, eager).

    PYTHONPATH=/tmp/site:/tmp/mcore:packages/rlk-core/src:packages/rlk-validate/src:packages/rlk-collectives/src:\
packages/rlk-vllm-plugin/src:packages/rlk-megatron-provider/src:packages/rlk-repro/src \
    python3 benchmarks/frameworks/attribute_gpu.py --ladder /tmp/sit/ladder --out $OUT --budget-s 560

Leaves ``attr/<rung>[-inject]/`` (``attribution.json`` / ``.md``; the dumps are deleted unless
``--keep-dumps``: hundreds of MB a rung), ``attribution-reports.tar.xz`` (every ``attribution.json`` / ``.md``),
``logs/`` and ``attribute_gpu.json`` / ``attribute_gpu.md`` (per attribution: verdict, boundary, each probe's
status). Exit 1 if an attribution failed to run or a control did not come out as it must (R/R: ``no_boundary``;
R/R injected: the injected point).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_gpu import _dump, _stage, setup  # one stage runner, one plugin dist-info writer

RUNGS = "0-aligned,1-fp8,2-top-p,rr-0-aligned"
INJECT = ("rr-0-aligned", "train:1:ffn.down", "layers.1.ffn.down")


def _root(ladder: Path | None) -> Path | None:
    roots = sorted(q for q in (ladder / "ladder").iterdir() if q.is_dir()) if ladder and (ladder / "ladder").is_dir() \
        else []
    return roots[-1] if roots else None


def _summary(doc: dict) -> dict:
    v = doc.get("verdict") or {}
    b = v.get("boundary") or {}
    return {"verdict": v.get("kind"), "summary": v.get("summary"), "boundary": b.get("point"),
            "train_ops": b.get("train_ops"), "rollout_ops": b.get("rollout_ops"), "max_abs_diff": b.get("max_abs_diff"),
            "first_difference_unattributed": v.get("first_difference_unattributed"),
            "probes": {str(p["id"]): p["status"] for p in doc.get("probes", [])},
            "probe_details": {str(p["id"]): p["detail"] for p in doc.get("probes", [])},
            "replay_notes": doc.get("replay_notes"), "positions": doc.get("positions_compared"),
            "missing": (doc.get("layers") or {}).get("missing")}


def _markdown(res: dict) -> str:
    lines = ["# attribution of the ladder's frameworks rungs (H200)", "", f"ladder root: `{res.get('ladder_root')}`",
             "", "| attribution | rc | verdict | boundary | train ops | rollout ops | max abs diff | probes 0-7 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in res["attributions"].items():
        s = r.get("summary") or {}
        probes = " ".join(f"{k}:{v}" for k, v in sorted((s.get("probes") or {}).items()))
        where = s.get("boundary") or s.get("first_difference_unattributed")
        lines.append(f"| {name} | {r.get('rc')} | {s.get('verdict')} | {where} | {s.get('train_ops')} | "
                     f"{s.get('rollout_ops')} | {s.get('max_abs_diff')} | {probes} |")
    lines += ["", "Controls: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in res["controls"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ladder", type=Path, default=None, help="the ladder stage's output (its ladder/ladder-* root)")
    p.add_argument("--budget-s", type=float, default=560)
    p.add_argument("--rungs", default=RUNGS)
    p.add_argument("--max-sequences", type=int, default=2,
                   help="sequences of round 0 compared per rung: sample 0 of the first N prompts (default 2)")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--keep-dumps", action="store_true", help="keep each attribution's dumps/ and ab-tensors")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    out, _, env, res = setup(a)
    env = {**env, "RLK_REQUIRE_GPU": "1"}
    res.update(attributions={}, controls={})

    def left() -> float:
        return a.budget_s - (time.monotonic() - t0)

    def save() -> None:
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        _dump(out / "attribute_gpu.json", res)
        (out / "attribute_gpu.md").write_text(_markdown(res))

    root = _root(a.ladder)
    if root is None:  # no ladder stage before: the rungs this stage attributes, one round each
        (out / "ladder").mkdir(exist_ok=True)
        res["stages"]["ladder"] = _stage("ladder", [
            sys.executable, "-m", "rlk_repro", "ladder", "--engine", "frameworks", "--model", a.model, "--rounds", "1",
            "--prompts-per-round", str(a.prompts), "--samples-per-prompt", str(a.samples), "--max-new-tokens",
            str(a.max_new_tokens), "--enforce-eager", "--seed", str(a.seed), "--output", str(out / "ladder"),
            "--rungs", a.rungs], env, max(60.0, left() * 0.45), out)
        root = _root(out)
    res["ladder_root"] = str(root) if root else None
    save()
    jobs = [(r, r, None) for r in a.rungs.split(",")] + [(f"{INJECT[0]}-inject", INJECT[0], INJECT[1])]
    for name, rung, inject in jobs:
        run = root / rung if root else None
        if run is None or not (run / "manifest.json").is_file():
            res["attributions"][name] = {"rc": None, "error": f"no run directory for rung {rung} under {root}"}
            continue
        dest = out / "attr" / name
        dest.parent.mkdir(exist_ok=True)
        n = int((json.loads((run / "manifest.json").read_text()).get("config") or {}).get("samples_per_prompt", 1))
        # sample 0 of the first prompts: a later sample of a prompt shares its prompt's cached KV (prefix caching),
        # so vLLM computes none of its prompt rows and only the response's are compared
        seqs = ",".join(str(i * n) for i in range(a.max_sequences))
        cmd = [sys.executable, "-m", "rlk_repro", "attribute", str(run), "--sequences", seqs, "--output", str(dest),
               *(["--inject", inject] if inject else [])]
        entry = _stage(f"attribute-{name}", cmd, env, max(30.0, min(150.0, left() - 10)), out)
        if (dest / "attribution.json").is_file():
            entry["summary"] = _summary(json.loads((dest / "attribution.json").read_text()))
        if not a.keep_dumps:  # hundreds of MB a rung at the 0.6B shape: the reports are what comes back
            shutil.rmtree(dest / "dumps", ignore_errors=True)
            (dest / "ab-tensors.safetensors").unlink(missing_ok=True)
        res["attributions"][name] = entry
        save()
    got = {k: (v.get("summary") or {}) for k, v in res["attributions"].items()}
    res["controls"] = {"rr-0-aligned: no_boundary": got.get(INJECT[0], {}).get("verdict") == "no_boundary",
                       f"{INJECT[0]}-inject: {INJECT[2]}": got.get(f"{INJECT[0]}-inject", {}).get("boundary")
                       == INJECT[2]}
    with tarfile.open(out / "attribution-reports.tar.xz", "w:xz") as tar:
        for f in sorted((out / "attr").glob("*/attribution.*")) if (out / "attr").is_dir() else []:
            tar.add(f, arcname=str(f.relative_to(out)))
    save()
    print((out / "attribute_gpu.md").read_text())
    ran = all(v.get("rc") == 0 for v in res["attributions"].values())
    return 0 if ran and all(res["controls"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
