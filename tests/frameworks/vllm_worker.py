#!/usr/bin/env python3
"""The bitwise checks of rlk-vllm-plugin inside real vLLM, launched by ``tests/frameworks/test_vllm_exact.py``:
vLLM's R/R rollout log-probs equal rlk-repro's training-side recompute bit for bit, and so do a prompt alone and the
same prompt in the batch, the same batch run twice, and the eager engine and the CUDA-graph one; the plugin off
(P/P, vLLM's own kernels) differs (negative control); the readbacks show rlk on every module (and, at TP 2, the rlk
all-reduce on every worker).

Stages (each its own process, ``tests/frameworks/vllm_stages.py``):

=============  ==============================================================================================
``ckpt``       Qwen3-0.6B-shaped random bf16 checkpoint (rlk-repro's writer, HF layout) + token-id prompts
``rr``         R/R strict, ``attention_backend=CUSTOM``, CUDA graphs: the batch (prompts x samples, ``logprobs=0``,
               T=1, top_p 1, top_k 0, ignore_eos), the same batch again on a cleared prefix cache, a few prompts
               alone
``pp``         the plugin off (P/P, default backend), the same seeds, enough prompts for ``--control-seqs``
``eager``      R/R with ``enforce_eager=True`` on the first ``--eager-prompts`` prompts
``recompute``  rlk-repro's ``Trainer`` (consistency plan, train side, bf16, same checkpoint) recomputes every R/R and
               eager sequence and the P/P ones; fp32 log-probs compared per token
=============  ==============================================================================================

Writes ``vllm_exact.json`` / ``.md`` (+ the readbacks and stage logs as tarballs) to ``--out``; exit 1 unless every
required check passed. ``--device cpu --tiny``: rlk-repro's local rollout engine stands in for vLLM, so the stages
and comparisons run without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import vllm_stages as V

ORDER = ("ckpt", "rr", "pp", "eager", "recompute")
CAPS = {"ckpt": 120, "rr": 260, "pp": 150, "eager": 120, "recompute": 170}  # per-stage wall-clock caps (s)
REQUIRED = ("rr.logp_equal_trainer", "rr.alone_equal_batch", "rr.repeat_equal_first", "eager.equal_cuda_graphs",
            "pp.differs_from_trainer", "rr.readback_rlk", "eager.readback_rlk")


def stage_generate(a, work: Path, name: str) -> dict:
    import torch

    prompts_all = V.prompts_of(work)
    n = a.num_prompts or a.prompts
    if name == "eager":
        n = min(n, a.eager_prompts)
    if name == "pp":
        n = min(n, math.ceil(a.control_seqs / a.samples))
    engine = V.open_engine(a, work, name)
    res = V.engine_info(engine, name)
    idx = list(range(n))
    recs = engine.generate(a, [prompts_all[i] for i in idx], idx, a.samples, a.max_tokens)
    res["generate"] = {"prompts": n, "samples": a.samples, "max_tokens": a.max_tokens, "sequences": len(recs),
                       "output_tokens": sum(len(r["tokens"]) for r in recs)}
    data = {"batch": recs}
    if name == "rr":
        engine.reset_prefix_cache()  # the same requests again, every prompt prefilled again: run-to-run bits
        again = engine.generate(a, [prompts_all[i] for i in idx], idx, a.samples, a.max_tokens)
        res["repeat_vs_first"] = V._same_records(again, recs)
        engine.reset_prefix_cache()  # alone: the whole prompt prefilled again, not read from the batch's cache
        data["alone"] = []
        for i in idx[: a.alone]:
            data["alone"] += engine.generate(a, [prompts_all[i]], [i], a.samples, a.max_tokens)
        res["alone"] = {"prompts": idx[: a.alone]}
    res.update(V.engine_readbacks(a, engine))
    torch.save(data, work / f"{name}.pt")
    V.close_engine(engine)
    return res


# -- the training-side recompute and the comparison ------------------------------------------------------
def _recompute(trainer, prompts_all, recs, max_tokens_per_chunk: int):
    """Per record: the trainer's fp32 log-probs of its sampled tokens (a list of tensors)."""
    import torch

    out, chunk, ntok = [], [], 0

    def flush():
        if not chunk:
            return
        seqs = [prompts_all[r["p"]] + r["tokens"] for r in chunk]
        rows, start = [], 0
        for r, s in zip(chunk, seqs, strict=True):
            lp = len(prompts_all[r["p"]])
            rows.append(torch.arange(start + lp - 1, start + len(s) - 1))
            start += len(s) - 1
        with torch.no_grad():
            lps = trainer.forward_logprobs(seqs, torch.cat(rows).to(trainer.device)).float().cpu()
        out.extend(lps.split([len(r["tokens"]) for r in chunk]))
        chunk.clear()

    for r in recs:
        n = len(prompts_all[r["p"]]) + len(r["tokens"])
        if chunk and ntok + n > max_tokens_per_chunk:
            flush()
            ntok = 0
        chunk.append(r)
        ntok += n
    flush()
    return out


def _compare(recs, ref) -> dict:
    """Bitwise comparison of engine log-probs (fp32) with the trainer's."""
    import torch

    tokens = mism = seq_mism = 0
    max_abs = 0.0
    examples = []
    for r, t in zip(recs, ref, strict=True):
        got = torch.tensor(r["logprobs"], dtype=torch.float32)
        if got.shape != t.shape:
            seq_mism += 1
            mism += len(r["tokens"])
            tokens += len(r["tokens"])
            examples.append({"p": r["p"], "s": r["s"], "error": f"shape {tuple(got.shape)} vs {tuple(t.shape)}"})
            continue
        bad = got != t
        tokens += got.numel()
        k = int(bad.sum())
        if k:
            mism += k
            seq_mism += 1
            d = float((got.double() - t.double()).abs().max())
            max_abs = max(max_abs, d)
            if len(examples) < 5:
                j = int(bad.nonzero()[0])
                examples.append({"p": r["p"], "s": r["s"], "pos": j, "engine": float(got[j]), "trainer": float(t[j])})
    return {"tokens": tokens, "mismatched_tokens": mism, "sequences": len(recs), "mismatched_sequences": seq_mism,
            "max_abs_diff": max_abs, "examples": examples}


def stage_recompute(a, work: Path) -> dict:
    import torch

    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model import weights as W
    from rlk_repro.model.ops import Ops

    dev = torch.device(a.device)
    cfg, w = W.load_checkpoint(work / "ckpt")
    plan = RoutePlan.preset("consistency")
    rec = ReadbackRecorder("megatron", "train", plan)  # the local trainer is the Megatron stand-in
    trainer = Trainer(cfg, w, Ops(plan, "train", rec), device=dev, dtype=torch.bfloat16, temperature=1.0)
    del w
    prompts_all = V.prompts_of(work)
    res: dict = {"plan": plan.name, "device": str(dev)}
    for name, limit in (("rr", None), ("pp", a.control_seqs), ("eager", None)):
        f = work / f"{name}.pt"
        if not f.exists():
            res[name] = {"skipped": f"{f.name} missing (stage did not finish)"}
            continue
        recs = torch.load(f)["batch"]
        recs = recs if limit is None else recs[:limit]
        t0 = time.perf_counter()
        ref = _recompute(trainer, prompts_all, recs, a.recompute_chunk)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res[name] = {**_compare(recs, ref), "recompute_s": round(time.perf_counter() - t0, 2)}
    res["readback"] = rec.to_dict().get("modules")
    rb = Path(os.environ["RL_KERNEL_READBACK_DIR"])
    rb.mkdir(parents=True, exist_ok=True)
    V._json_dump(rb / f"trainer-{os.getpid()}.json", rec.to_dict())
    return res


def evaluate(result: dict, work: Path) -> None:
    import torch

    checks: list = []

    def check(name, passed, required, **numbers):
        checks.append({"name": name, "passed": passed, "required": required, **numbers})

    st = result["stages"]
    tp = int(result.get("meta", {}).get("tp", 1) or 1)
    rc = st.get("recompute", {}).get("result") or {}
    rr, pp, eg = rc.get("rr") or {}, rc.get("pp") or {}, rc.get("eager") or {}
    if "tokens" in rr:  # the trainer recomputes at TP 1: under TP > 1 the row-parallel sums differ by contract
        check("rr.logp_equal_trainer", rr["mismatched_tokens"] == 0 and rr["tokens"] > 0, tp == 1, tokens=rr["tokens"],
              mismatched_tokens=rr["mismatched_tokens"], mismatched_sequences=rr["mismatched_sequences"],
              max_abs_diff=rr["max_abs_diff"], examples=rr["examples"])
    if "tokens" in pp:
        check("pp.differs_from_trainer", pp["mismatched_tokens"] > 0, True, tokens=pp["tokens"],
              mismatched_tokens=pp["mismatched_tokens"], max_abs_diff=pp["max_abs_diff"])
    if "tokens" in eg:
        check("eager.logp_equal_trainer", eg["mismatched_tokens"] == 0 and eg["tokens"] > 0, False,
              tokens=eg["tokens"], mismatched_tokens=eg["mismatched_tokens"])
    data = {n: torch.load(work / f"{n}.pt") for n in ("rr", "eager") if (work / f"{n}.pt").exists()}
    if "rr" in data and data["rr"].get("alone"):
        s = V._same_records(data["rr"]["alone"], data["rr"]["batch"])
        check("rr.alone_equal_batch", s["sequences"] > 0 and s["token_ids_differ"] == 0 and s["logprobs_differ"] == 0,
              True, **s)
    again = (st.get("rr", {}).get("result") or {}).get("repeat_vs_first")
    if again:
        check("rr.repeat_equal_first", again["sequences"] > 0 and again["token_ids_differ"] == 0
              and again["logprobs_differ"] == 0, True, **again)
    if "rr" in data and "eager" in data:
        s = V._same_records(data["eager"]["batch"], data["rr"]["batch"])
        check("eager.equal_cuda_graphs", s["sequences"] > 0 and s["token_ids_differ"] == 0
              and s["logprobs_differ"] == 0, True, **s)
    # readbacks. Under CUDA graphs the compiled pieces (the FFN, the attention block's GEMMs) run as opaque
    # torch.ops.rlk.* without the plugin's module scope, so only eager-side calls are counted there: the
    # graph run must show no production backend and no fallback for any module it counts, and the eager
    # run must count rlk calls for all three modules.
    rb = result.get("readbacks", {})
    for name, need_all in (("rr", False), ("eager", True)):
        if rb.get(name) is None:
            continue
        mods = rb[name]["modules"]
        counted = {m for m, v in mods.items() if v["call_count"] > 0}
        clean = not any(v["fallback"] for v in mods.values()) and not any(
            b.startswith("production") for v in mods.values() for b in v["backend_ids"])
        ok = clean and bool(counted) and (counted == {"attention", "ffn", "logp"} or not need_all)
        check(f"{name}.readback_rlk", ok, True, counted_modules=sorted(counted), modules=mods, files=rb[name]["files"],
              hooks=rb[name].get("hooks"))
    if tp > 1:  # every TP worker's readback shows the rlk all-reduce (custom all-reduce / fused pass not taken)
        for name in ("rr", "eager"):
            if rb.get(name) is None:
                continue
            procs = [p for p in rb[name].get("processes", []) if p.get("world_size") == tp]
            ranks = {p["rank"] for p in procs if p["all_reduce"] and all(
                v["backend_id"].startswith("rlk.") and v["call_count"] > 0 for v in p["all_reduce"].values())}
            check(f"{name}.tp{tp}_rlk_all_reduce_every_worker", ranks == set(range(tp)), True,
                  ranks_with_rlk_all_reduce=sorted(ranks), processes=procs)
    if rb.get("pp") is not None:
        mods = rb["pp"]["modules"]
        rlk_ran = [m for m, v in mods.items() if any(not b.startswith("production") for b in v["backend_ids"])]
        check("pp.readback_nothing_rlk", not rlk_ran, False, modules=mods, files=rb["pp"]["files"])
    names = {c["name"] for c in checks}
    for req in REQUIRED:
        if req not in names and not (tp > 1 and req == "rr.logp_equal_trainer"):
            check(req, False, True, error="not evaluated (its stage failed, was skipped or ran out of time)")
    result["checks"] = checks
    result["passed"] = all(c["passed"] for c in checks if c["required"])


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = ["# rlk-vllm-plugin in real vLLM: bitwise rollout vs training recompute", "",
             f"GPU: {m.get('gpu')} · torch {m.get('torch')} · vLLM {m.get('vllm')} · Triton {m.get('triton')} · "
             f"RLK_COMMIT {m.get('RLK_COMMIT')} · engine {m.get('engine')} · "
             f"{'PASS' if result.get('passed') else 'FAIL'}",
             "", "| check | required | result | numbers |", "| --- | --- | --- | --- |"]
    for c in result.get("checks", []):
        res = {True: "PASS", False: "FAIL", None: "info"}[c["passed"]]
        nums = {k: v for k, v in c.items()
                if k not in ("name", "passed", "required", "modules", "files", "examples", "hooks", "processes")}
        lines.append(f"| {c['name']} | {'yes' if c['required'] else 'no'} | {res} | `{json.dumps(nums)[:400]}` |")
    lines += ["", "| stage | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {n} | {s.get('status')} | {s.get('seconds')} |" for n, s in result["stages"].items()]
    errs = [(n, s["error"]) for n, s in result["stages"].items() if s.get("error")]
    if errs:
        lines += ["", "## Errors", ""] + [f"- `{n}`: {e[:500]}" for n, e in errs]
    return "\n".join(lines) + "\n"


STAGES = {"ckpt": V.stage_ckpt, "rr": lambda a, w: stage_generate(a, w, "rr"),
          "pp": lambda a, w: stage_generate(a, w, "pp"), "eager": lambda a, w: stage_generate(a, w, "eager"),
          "recompute": lambda a, w: stage_recompute(a, w)}


def main(argv=None) -> int:
    p = V.parser(__doc__.split("\n\n")[0], ORDER)
    p.add_argument("--alone", type=int, default=4, help="prompts also generated alone (batch of 1)")
    p.add_argument("--eager-prompts", type=int, default=32, help="prompts of the enforce_eager run")
    p.add_argument("--control-seqs", type=int, default=512, help="P/P sequences generated and recomputed")
    p.add_argument("--recompute-chunk", type=int, default=16384, help="tokens per trainer forward")
    a = V.checked(p, p.parse_args(argv))
    a.passed = (*V.COMMON, "alone", "eager_prompts", "control_seqs", "recompute_chunk")
    if a.stage:
        return V.run_stage(a, STAGES)
    result = V.drive(a, Path(__file__).resolve(), "vllm_exact", ORDER, CAPS, evaluate, markdown)
    V.finish_work(result, a.keep_work)
    passed = bool(result.get("passed")) and "evaluate_error" not in result
    print(json.dumps({"passed": passed, "elapsed_s": result["elapsed_s"],
                      "evaluate_error": result.get("evaluate_error"),
                      "checks": {c["name"]: c["passed"] for c in result.get("checks", [])}}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
