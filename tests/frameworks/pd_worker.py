#!/usr/bin/env python3
"""A Prefill/Decode split on one GPU (issue 37, ``rlk-repro plan --pd``): a prefill engine and a decode engine, real
vLLM with rlk-vllm-plugin (R/R), joined by ``rlk_vllm_plugin.kv_connector.RlkSharedStorageConnector``, launched by
``tests/frameworks/test_pd_exact.py``. The decode engine's sampled tokens and log-probs equal a single engine's bit
for bit and rlk-repro's training-side recompute's; the decode engine did load the prefill engine's KV (its connector
counts the rows, and KV from another checkpoint's prefill changes its output: the negative control); both engines ran
rlk on every module and carry one contract digest, and ``rlk-validate``'s P/D check passes on their readbacks.

Stages (each its own process, ``tests/frameworks/vllm_stages.py``; the engines one after another on one GPU, the KV
between them on the local disk):

=================  ===========================================================================================
``ckpt``           Qwen3-0.6B-shaped random bf16 checkpoint + token-id prompts (``--prompt-min`` >= 2 KV blocks + 2:
                   the connector moves the block-aligned prompt prefix); ``ckpt-other``: the same shape, another seed
``rr``             one R/R engine (the reference): set A (``--prompts`` x ``--samples``) and set B (``--control``)
``prefill``        R/R, ``kv_role=kv_producer``, eager: set A, one token each (dropped); its KV rows to the store
``prefill-other``  the same engine on ``ckpt-other``: set B's KV, from other weights, to the same store
``decode``         R/R, ``kv_role=kv_consumer``, CUDA graphs: sets A and B sampled from the store's KV
``recompute``      rlk-repro's ``Trainer`` (consistency plan, train side, bf16) recomputes set A's decode tokens
``inprocess``      measured, not required: both engines in ONE process, as the frameworks engine's loop would hold
                   them (vLLM keeps one KV-connector agent per process: which engine's is it, and does set A still
                   equal one engine's?); last, so the time budget drops it first
=================  ===========================================================================================

Writes ``pd_exact.json`` / ``.md`` (+ readbacks and logs as tarballs) to ``--out``; exit 1 unless every required check
passed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import vllm_stages as V
import vllm_worker as W

ORDER = ("ckpt", "rr", "prefill", "prefill-other", "decode", "recompute", "inprocess")
CAPS = {"ckpt": 90, "rr": 150, "prefill": 100, "prefill-other": 100, "decode": 150, "recompute": 120, "inprocess": 200}
REQUIRED = ("decode.equal_single_engine", "decode.logp_equal_trainer", "decode.loaded_prefill_kv",
            "decode.other_prefill_changes_output", "engines.one_contract_digest", "engines.readback_rlk",
            "engines.validate_pd")
ROUTES = {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R"}
ENGINE_OF = {"rr": None, "prefill": "kv_producer", "prefill-other": "kv_producer", "decode": "kv_consumer"}


def stage_ckpt(a, work: Path) -> dict:
    a.decode_batch = a.control  # the checkpoint stage writes prompts + extra ones: set B
    res = V.stage_ckpt(a, work)
    import torch

    from rlk_repro.model import weights as Wt

    cfg = V._model_cfg(a.tiny)
    other = work / "ckpt-other"
    Wt.save_checkpoint(other, cfg, Wt.random_weights(cfg, seed=a.seed + 17, dtype=torch.bfloat16))
    shutil.copy(work / "ckpt" / "config.json", other / "config.json")  # the same torch_dtype
    return res


def _sets(a, work: Path) -> tuple[list[list[int]], list[int], list[int]]:
    prompts = V.prompts_of(work)
    return prompts, list(range(a.prompts)), list(range(a.prompts, a.prompts + a.control))


def _digest(a) -> dict:
    """This engine's contract digest document, recorded in its readback as the frameworks engine's handshake does."""
    from rlk_core.digest import side_document
    from rlk_validate.digest import digest_of
    from rlk_vllm_plugin import _runtime

    rt = _runtime.current()
    doc, detail = side_document(rt.plan, "rollout", "cuda", temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                min_p=a.min_p, logprobs="processed", tp_leaves=rt.tp_leaves)
    d = digest_of(doc)
    rt.recorder.record_digest(d, doc, detail, "start")
    return {"digest": d, "plan": rt.plan.as_dict()}


def stage_engine(a, work: Path, name: str) -> dict:
    import torch

    from rlk_vllm_plugin import kv_connector

    os.environ.update(ROUTES)  # read by the plugin when vLLM loads it (the engine core runs in this process)
    role = ENGINE_OF[name]
    spec = {"case": "R/R", "env": {}, "backend": "CUSTOM", "eager": role == "kv_producer",
            "ckpt": "ckpt-other" if name == "prefill-other" else "ckpt"}
    if role is not None:
        spec["kwargs"] = {"kv_transfer_config": kv_connector.kv_transfer_config(role, str(work / "kv-store"))}
    prompts, set_a, set_b = _sets(a, work)
    t0 = time.perf_counter()
    engine = V._VllmEngine(a, work, spec)
    res: dict = {"info": engine.info(), "kv_role": role, "start_s": round(time.perf_counter() - t0, 1)}
    data: dict = {}
    if role == "kv_producer":  # one token per prompt: what matters is the KV it leaves in the store
        idx = set_a if name == "prefill" else set_b
        data["prefill"] = engine.generate(a, [prompts[i] for i in idx], idx, 1, 1)
    else:
        data["a"] = engine.generate(a, [prompts[i] for i in set_a], set_a, a.samples, a.max_tokens)
        data["b"] = engine.generate(a, [prompts[i] for i in set_b], set_b, a.samples, a.max_tokens)
    res["generate"] = {"prompts": a.prompts, "control": a.control, "samples": a.samples, "max_tokens": a.max_tokens}
    res["connector"] = dict(kv_connector.COUNTS)
    res["digest"] = _digest(a)
    res.update(V.engine_readbacks(a, engine))
    torch.save(data, work / f"{name}.pt")
    V.close_engine(engine)
    return res


def _agent() -> dict:
    from vllm.distributed.kv_transfer import kv_transfer_state

    agent = kv_transfer_state._KV_CONNECTOR_AGENT
    if agent is None:
        return {"agent": None}
    return {"agent": type(agent).__name__, "agent_kv_role": agent._kv_transfer_config.kv_role,
            "agent_engine_id": agent._kv_transfer_config.engine_id}


def stage_inprocess(a, work: Path) -> dict:
    """Both engines in this one process (measured: the frameworks engine's loop would need it)."""
    import torch

    from rlk_vllm_plugin import kv_connector

    os.environ.update(ROUTES)
    store = str(work / "kv-store-inprocess")
    prompts, set_a, _ = _sets(a, work)
    res: dict = {}
    pre = V._VllmEngine(a, work, {"case": "R/R", "env": {}, "backend": "CUSTOM", "eager": True, "kwargs": {
        "kv_transfer_config": kv_connector.kv_transfer_config("kv_producer", store)}})
    res["after_prefill_engine"] = {**_agent(), "engine_id": pre.llm.llm_engine.vllm_config.kv_transfer_config.engine_id}
    dec = V._VllmEngine(a, work, {"case": "R/R", "env": {}, "backend": "CUSTOM", "eager": False, "kwargs": {
        "kv_transfer_config": kv_connector.kv_transfer_config("kv_consumer", store)}})
    res["after_decode_engine"] = {**_agent(), "engine_id": dec.llm.llm_engine.vllm_config.kv_transfer_config.engine_id}
    before = dict(kv_connector.COUNTS)
    pre.generate(a, [prompts[i] for i in set_a], set_a, 1, 1)
    recs = dec.generate(a, [prompts[i] for i in set_a], set_a, a.samples, a.max_tokens)
    res["connector"] = {k: kv_connector.COUNTS[k] - before[k] for k in before}
    torch.save({"a": recs}, work / "inprocess.pt")
    V.close_engine(dec)
    V.close_engine(pre)
    return res


def stage_recompute(a, work: Path) -> dict:
    import torch

    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model import weights as Wt
    from rlk_repro.model.ops import Ops

    dev = torch.device(a.device)
    cfg, w = Wt.load_checkpoint(work / "ckpt")
    plan = RoutePlan.preset("consistency")
    rec = ReadbackRecorder("megatron", "train", plan)  # the local trainer is the Megatron stand-in
    trainer = Trainer(cfg, w, Ops(plan, "train", rec), device=dev, dtype=torch.bfloat16, temperature=a.temperature)
    del w
    recs = torch.load(work / "decode.pt")["a"]
    t0 = time.perf_counter()
    ref = W._recompute(trainer, V.prompts_of(work), recs, 16384)
    return {**W._compare(recs, ref), "recompute_s": round(time.perf_counter() - t0, 2)}


def _validate_pd(result: dict, work: Path) -> dict:
    """rlk-validate's P/D check (rlk_validate.pd) on the two engines' readbacks, as a run directory lists them."""
    from rlk_validate.evidence import PD_LAYOUT_SCHEMA
    from rlk_validate.pd import check_pd
    from rlk_validate.safeio import Root

    run = work / "pd-evidence"
    shutil.rmtree(run, ignore_errors=True)
    layout: dict = {"schema": PD_LAYOUT_SCHEMA, "connector": {"class": "RlkSharedStorageConnector",
                                                                 "lossless_for_rlk_layout": True}}
    for role, stage, kv_role in (("prefill", "prefill", "kv_producer"), ("decode", "decode", "kv_consumer")):
        rels = []
        for f in sorted((work / "readbacks" / stage).rglob("vllm-rollout-*.json")):
            rel = f"readbacks/{stage}/{f.name}"
            (run / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, run / rel)
            rels.append(rel)
        layout[role] = {"kv_role": kv_role, "routes": {"attention": "R", "ffn": "R", "logp": "R"}, "readbacks": rels}
    digest = ((result["stages"].get("decode") or {}).get("result") or {}).get("digest", {}).get("digest")
    manifest = {"plan": {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}, "pd": layout, "contract_digest": digest}
    findings = check_pd(Root(str(run), check="pd"), manifest, True)
    return {"findings": [f.to_json() for f in findings],
            "readbacks": {r: layout[r]["readbacks"] for r in ("prefill", "decode")}}


def evaluate(result: dict, work: Path) -> None:
    import torch

    checks: list = []

    def check(name, passed, required, **numbers):
        checks.append({"name": name, "passed": passed, "required": required, **numbers})

    st = result["stages"]
    res = {n: (st.get(n) or {}).get("result") or {} for n in ORDER}
    data = {n: torch.load(work / f"{n}.pt") for n in ("rr", "decode") if (work / f"{n}.pt").exists()}
    if len(data) == 2:
        s = V._same_records(data["decode"]["a"], data["rr"]["a"])
        check("decode.equal_single_engine", s["sequences"] > 0 and s["token_ids_differ"] == 0
              and s["logprobs_differ"] == 0, True, **s)
        o = V._same_records(data["decode"]["b"], data["rr"]["b"])
        differ = o["token_ids_differ"] + o["logprobs_differ"]
        check("decode.other_prefill_changes_output", o["sequences"] > 0 and differ == o["sequences"], True, **o)
    rc = res["recompute"]
    if "tokens" in rc:
        check("decode.logp_equal_trainer", rc["mismatched_tokens"] == 0 and rc["tokens"] > 0, True,
              **{k: rc[k] for k in ("tokens", "mismatched_tokens", "mismatched_sequences", "max_abs_diff")})
    pre, dec = res["prefill"].get("connector"), res["decode"].get("connector")
    if pre and dec:
        check("decode.loaded_prefill_kv", pre["saved_rows"] > 0 and dec["loaded_rows"] > 0, True, prefill=pre,
              decode=dec, prefill_other=res["prefill-other"].get("connector"))
    digests = {n: (res[n].get("digest") or {}).get("digest") for n in ("rr", "prefill", "prefill-other", "decode")}
    if digests["prefill"] and digests["decode"]:
        check("engines.one_contract_digest", len({digests[n] for n in ("rr", "prefill", "decode")}) == 1, True,
              **digests)
    mods_ok, summaries = True, {}
    for n in ("prefill", "decode"):
        summaries[n] = V._readback_summary(work / "readbacks" / n)
        mods = summaries[n]["modules"]
        counted = {m for m, v in mods.items() if v["call_count"] > 0}
        clean = not any(v["fallback"] for v in mods.values()) and not any(
            b.startswith("production") for v in mods.values() for b in v["backend_ids"])
        mods_ok &= clean and bool(counted)
    if summaries["prefill"]["files"] and summaries["decode"]["files"]:
        check("engines.readback_rlk", mods_ok, True, readbacks=summaries)
        vp = _validate_pd(result, work)
        check("engines.validate_pd", not vp["findings"], True, **vp)
    ip = st.get("inprocess") or {}
    if ip.get("status") not in (None, "skipped"):  # measured, not required: can the loop hold both engines?
        if (work / "inprocess.pt").exists() and "rr" in data:
            s = V._same_records(torch.load(work / "inprocess.pt")["a"], data["rr"]["a"])
            check("inprocess.equal_single_engine", s["sequences"] > 0 and s["token_ids_differ"] == 0
                  and s["logprobs_differ"] == 0, False, **s, **(ip.get("result") or {}))
        elif ip.get("error") == "timeout (budget)":  # not measured: the time ran out, not the engines
            check("inprocess.pair_runs", None, False, error=ip.get("error"))
        else:
            check("inprocess.pair_runs", False, False, error=ip.get("error"),
                  log_tail=(ip.get("log_tail") or "")[-1500:])
    names = {c["name"] for c in checks}
    for req in REQUIRED:
        if req not in names:
            check(req, False, True, error="not evaluated (its stage failed, was skipped or ran out of time)")
    result["checks"] = checks
    result["passed"] = all(c["passed"] for c in checks if c["required"])


def markdown(result: dict) -> str:
    return W.markdown(result).replace("bitwise rollout vs training recompute",
                                      "a Prefill/Decode split on one GPU (R/R) vs one engine and the trainer")


STAGES = {"ckpt": stage_ckpt, "rr": lambda a, w: stage_engine(a, w, "rr"),
          "prefill": lambda a, w: stage_engine(a, w, "prefill"),
          "prefill-other": lambda a, w: stage_engine(a, w, "prefill-other"),
          "decode": lambda a, w: stage_engine(a, w, "decode"), "recompute": stage_recompute,
          "inprocess": stage_inprocess}


def main(argv=None) -> int:
    p = V.parser(__doc__.split("\n\n")[0], ORDER)
    p.add_argument("--control", type=int, default=16, help="prompts of set B (the other checkpoint's prefill)")
    p.set_defaults(prompts=64, prompt_min=48, prompt_max=160, max_tokens=64, gpu_mem=0.4, budget_s=500.0,
                   ttft_runs=0, decode_batch=0)
    a = V.checked(p, p.parse_args(argv))
    if a.engine != "vllm" or a.tp != 1:
        p.error("the P/D split runs two vLLM engines on one CUDA GPU (--engine vllm, --tp 1)")
    a.passed = (*V.COMMON, "control")
    if a.stage:
        return V.run_stage(a, STAGES)
    result = V.drive(a, Path(__file__).resolve(), "pd_exact", ORDER, CAPS, evaluate, markdown)
    V.finish_work(result, a.keep_work)
    passed = bool(result.get("passed")) and "evaluate_error" not in result
    print(json.dumps({"passed": passed, "elapsed_s": result["elapsed_s"],
                      "evaluate_error": result.get("evaluate_error"),
                      "checks": {c["name"]: c["passed"] for c in result.get("checks", [])}}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
