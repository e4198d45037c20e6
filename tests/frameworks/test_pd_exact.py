"""A Prefill/Decode split on one GPU (issue 37), zero tolerance: a prefill engine and a decode engine (real vLLM,
rlk-vllm-plugin, R/R) joined by rlk's shared-storage KV connector; the decode engine's tokens and log-probs equal one
engine's and the trainer's recompute bit for bit, it did load the prefill engine's KV (KV from other weights changes
its output: the negative control), both engines ran rlk and carry one contract digest, and rlk-validate's P/D check
passes on their readbacks. ``pd_worker.py`` runs each engine in its own process; the sitting's stage ``exact-pd``
runs this file on the H200."""

from __future__ import annotations

import sys

import pytest
from _frameworks import HERE, checks, failed
from pd_worker import REQUIRED

WORKER = str(HERE / "pd_worker.py")


@pytest.mark.gpu
@pytest.mark.vllm
def test_prefill_decode_split_equals_one_engine_and_the_trainer_gpu(worker, tmp_path):
    """Qwen3-0.6B shape, 64 prompts (48..160 tokens) x 8 samples x 64 tokens, 16 control prompts."""
    proc = worker([sys.executable, WORKER, "--out", str(tmp_path), "--budget-s", "500"], timeout=550, name="pd")
    assert proc.returncode == 0, failed(proc, tmp_path / "pd_exact.json")
    got = checks(tmp_path / "pd_exact.json")
    assert [n for n in REQUIRED if not got.get(n, {}).get("passed")] == [], failed(proc, tmp_path / "pd_exact.json")
    assert got["decode.logp_equal_trainer"]["tokens"] >= 30_000


def test_the_worker_refuses_the_cpu_in_one_line(worker, tmp_path):
    proc = worker([sys.executable, WORKER, "--device", "cpu", "--out", str(tmp_path)], timeout=120)
    assert proc.returncode == 2 and "two vLLM engines on one CUDA GPU" in proc.log.strip().splitlines()[-1]


def _evidence(work, *, other_equal=False, decode_digest_temperature=1.0):
    """A work folder as the GPU stages leave it: the engines' readbacks (written by rlk-core's recorder, with the
    digest the stages record), the stages' results and records."""
    import torch

    from rlk_core.digest import side_document
    from rlk_core.plan import MODULES, RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_validate.digest import digest_of

    plan = RoutePlan.preset("consistency")
    digests = {}
    for stage, temperature in (("rr", 1.0), ("prefill", 1.0), ("prefill-other", 1.0),
                               ("decode", decode_digest_temperature)):
        rec = ReadbackRecorder("vllm", "rollout", plan, mode="strict", directory=work / "readbacks" / stage / "host")
        for m in MODULES:
            rec.count(m, f"{m}.main", "rlk.reference", f"rlk.{m}.v1")
        doc, detail = side_document(plan, "rollout", "cuda", temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                    logprobs="processed", tp_leaves=0)
        digests[stage] = digest_of(doc)
        rec.record_digest(digests[stage], doc, detail, "start")
        rec.flush()

    def recs(seed, n=4):
        g = torch.Generator().manual_seed(seed)
        return [{"p": i, "s": 0, "tokens": torch.randint(0, 50, (6,), generator=g).tolist(),
                 "logprobs": (-torch.rand(6, generator=g)).tolist()} for i in range(n)]

    torch.save({"a": recs(1), "b": recs(2)}, work / "rr.pt")
    torch.save({"a": recs(1), "b": recs(2) if other_equal else recs(3)}, work / "decode.pt")
    counts = {"saved_rows": 64, "saved_files": 8, "loaded_rows": 0, "loaded_files": 0}
    res = {s: {"digest": {"digest": d}, "connector": counts} for s, d in digests.items()}
    res["decode"]["connector"] = {**counts, "saved_rows": 0, "loaded_rows": 64}
    res["recompute"] = {"tokens": 24, "mismatched_tokens": 0, "mismatched_sequences": 0, "max_abs_diff": 0.0}
    return {"stages": {s: {"result": r} for s, r in res.items()}}


def test_the_worker_s_checks_pass_on_consistent_evidence_and_fail_otherwise(tmp_path):
    """The evaluation of the GPU stages' outputs, rlk-validate's P/D check included, on evidence written by rlk's own
    recorder: every required check passes; the negative controls fail the check each guards."""
    from pd_worker import evaluate

    def verdict(name, **kw):
        work = tmp_path / name
        work.mkdir()
        result = _evidence(work, **kw)
        evaluate(result, work)
        return result["passed"], {c["name"]: c["passed"] for c in result["checks"]}

    passed, got = verdict("good")
    assert passed and all(got[n] for n in REQUIRED), got
    passed, got = verdict("other", other_equal=True)  # the decode engine ignored the KV it was given
    assert not passed and not got["decode.other_prefill_changes_output"]
    passed, got = verdict("digest", decode_digest_temperature=0.7)
    assert not passed and not got["engines.one_contract_digest"] and not got["engines.validate_pd"]
