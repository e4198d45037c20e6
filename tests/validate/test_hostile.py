"""The hostile suite (issue 16): run directories a careful adversary would write, one distinct fault
each, grouped by the class of defect they probe. Every case gets its expected verdict and finding,
calmly (no traceback, no exit 4), in seconds, and plain validation leaves the input byte-identical.

Classes: 1 loose matching of closed vocabularies; 2 claims not recomputed; 3 type confusion; 4 empty is
not evidence; 5 the seal must be verifiable; 6 matrix provenance (test_matrix_hostile below); 7 bounded
work on hostile sizes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from validate_builders import build_matrix, build_run, mutate_json, read_json, tree_state, write_json
from validate_mutations import (
    PR_ATTN,
    Case,
    _all_tensors,
    _bitwise,
    _deep,
    _extra_ops,
    _forged_seal,
    _manifest,
    _metrics,
    _module_and_ops,
    _raw,
    _rb,
    _remove,
    _sealed_then,
    _set,
    _tensors,
    _write,
    run_case,
)

C = Case
ARABIC_ZEROS = "\u0660" * 4
NINES = "9" * 5000
UNICODE_NAME = f"round-{ARABIC_ZEROS}.rank0.safetensors"
F, I, P = "failed", "incomplete", "passed"


def _plan_set(module: str, value: str):
    return lambda d: d["plan"].__setitem__(module, value)


def _rewrite_metrics_key(key: str, fn):
    return _metrics(lambda rows: [r.__setitem__(key, fn(r[key])) for r in rows])


def _round1(fn):
    return _metrics(lambda rows: fn(rows[1]))


def _bw_round(i: int, **kv):
    return _bitwise(lambda d: d["rounds"][i].update(kv))


def _scale(key: str, k: float):
    return lambda d: d.update({key: d[key] * k})


def _meta(**kv):
    meta = {"schema": "rlk.train-data.v1", "round": "0", "rank": "0", **kv}
    return _tensors(0, lambda t: None, meta)


def _copy_readback(pid: int):
    def fn(run: Path) -> None:
        d = read_json(_rb(run))
        d["pid"] = pid
        write_json(run / "readbacks" / f"local-training-{pid}.json", d)

    return fn


def _edit_loss(run: Path) -> None:
    p = run / "metrics.jsonl"
    p.write_text(p.read_text().replace('"loss": 0.1', '"loss": 0.05', 1))


def _edit_report(run: Path) -> None:
    p = run / "run-validation.json"
    p.write_text(p.read_text().replace('"verdict": "passed"', '"verdict": "passed" '))


def _many_metrics_lines(run: Path, tmp: Path) -> None:
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"schema": "rlk.metrics.v1", "round": -1}\n' * 100_000)


def _many_bitwise_rounds(d: dict) -> None:
    d["rounds"] += [{"round": 10 + i, "element_count": 0, "mismatch_count": 0, "max_abs_diff": 0.0}
                    for i in range(100_000)]


def _no_rewards_in_round(rnd: int):
    return _tensors(rnd, lambda t: (t.pop("rewards"), t.pop("advantages")))


CASES = [
    # -- 1. closed vocabularies are matched exactly ---------------------------------------------------
    C("plan-case-trailing-newline", _manifest(_plan_set("ffn", "R/R\n")), F, "PLAN_INVALID", "ffn"),
    C("plan-case-lowercase", _manifest(_plan_set("logp", "r/r")), F, "PLAN_INVALID", "logp"),
    C("plan-case-padded", _manifest(_plan_set("attention", " R/R")), F, "PLAN_INVALID", "attention"),
    C("plan-module-unknown", _manifest(lambda d: d["plan"].update(Attention="R/R")), F, "PLAN_INVALID", "Attention"),
    C("plan-narrower-than-modules", _manifest(lambda d: d["plan"].pop("logp")), F, "PLAN_INVALID", "lacks"),
    C("readback-plan-trailing-space", _set(_rb, _plan_set("ffn", "R/R ")), F, "PLAN_INVALID", "ffn"),
    C("readback-framework-newline", _set(_rb, lambda d: d.update(framework="local\n")), F,
      "READBACK_FIELD_INVALID", "framework"),
    C("readback-side-capitalised", _set(_rb, lambda d: d.update(side="Train")), F, "READBACK_FIELD_INVALID", "side"),
    C("readback-mode-prefix", _set(_rb, lambda d: d.update(mode="strictly")), F, "READBACK_FIELD_INVALID", "mode"),
    C("readback-target-prefix", _set(_rb, lambda d: d.update(target="train")), F, "READBACK_FIELD_INVALID",
      "target"),
    C("module-case-lowercase", _set(_rb, lambda d: d["modules"]["ffn"].update(case="r")), F,
      "READBACK_FIELD_INVALID", "case"),
    C("implementation-lookalike", _set(_rb, lambda d: d["modules"]["ffn"].update(implementation="rlk ")), F,
      "READBACK_FIELD_INVALID", "implementation"),
    C("execution-mode-newline", _set(_rb, lambda d: d["modules"]["ffn"].update(execution_mode="eager\n")), F,
      "READBACK_FIELD_INVALID", "execution_mode"),
    C("readback-schema-newline", _set(_rb, lambda d: d.update(schema="rlk.readback.v1\n")), F,
      "SCHEMA_UNSUPPORTED", "rlk.readback.v1"),
    C("manifest-schema-suffix", _manifest(lambda d: d.update(schema="rlk.manifest.v10")), F,
      "SCHEMA_UNSUPPORTED", "rlk.manifest.v10"),
    C("metrics-schema-uppercase", _metrics(lambda rows: rows[0].update(schema="RLK.metrics.v1")), F,
      "METRICS_INVALID", "schema"),
    C("bitwise-schema-padded", _bitwise(lambda d: d.update(schema=" rlk.bitwise-validation.v1")), F,
      "SCHEMA_UNSUPPORTED", "bitwise"),
    C("train-data-schema-newline", _meta(schema="rlk.train-data.v1\n"), F, "TENSOR_METADATA_INVALID", "schema"),
    C("manifest-mode-consistency-newline", _manifest(lambda d: d.update(mode="consistency\n")), F,
      "MANIFEST_FIELD_INVALID", "mode", plan=PR_ATTN),
    C("backend-bare-rlk-prefix", _set(_rb, _module_and_ops("ffn", backend_id="rlk.")), F, "R_NOT_RLK", "rlk."),
    C("backend-lookalike-prefix", _set(_rb, _module_and_ops("ffn", backend_id="rlkx.triton")), F, "R_NOT_RLK",
      "rlkx.triton"),
    C("exit-code-arabic-zero", _write("exit-code", "\u0660\n"), F, "EXIT_CODE_INVALID", "exit-code"),
    C("exit-code-two-newlines", _write("exit-code", "0\n\n"), F, "EXIT_CODE_INVALID", "exit-code"),
    C("sha-uppercase", _manifest(lambda d: d["repos"][0].update(sha=d["repos"][0]["sha"].upper())), F,
      "MANIFEST_FIELD_INVALID", "sha"),
    C("train-data-name-unicode-digits", lambda r, t: shutil.copy(
        r / "train-data" / "round-0000.rank0.safetensors", r / "train-data" / UNICODE_NAME), F,
      "TRAIN_DATA_UNEXPECTED", "not named"),
    # -- 2. every claimed number is recomputed -------------------------------------------------------
    C("metrics-compared-tokens-undercount", _round1(lambda r: r.update(compared_tokens=r["compared_tokens"] - 1)), F,
      "METRICS_DISAGREE", "compared_tokens"),
    C("metrics-max-diff-inflated", _round1(lambda r: r.update(max_abs_diff=r["max_abs_diff"] * 2)), F,
      "METRICS_DISAGREE", "max_abs_diff", plan=PR_ATTN),
    C("metrics-mean-diff-deflated", _round1(lambda r: r.update(mean_abs_diff=r["mean_abs_diff"] / 2)), F,
      "METRICS_DISAGREE", "mean_abs_diff", plan=PR_ATTN),
    C("metrics-mismatch-hidden", _round1(lambda r: r.update(mismatch_count=0)), F, "METRICS_DISAGREE",
      "mismatch_count", plan=PR_ATTN),
    C("metrics-reward-edited", _round1(lambda r: r.update(reward_mean=r["reward_mean"] + 0.25)), F,
      "METRICS_DISAGREE", "reward_mean"),
    C("rewards-absent-unverified", lambda r, t: None, P, "REWARDS_UNVERIFIED", "unverified",
      build={"rewards": False}),
    C("rewards-stripped-from-one-round", _no_rewards_in_round(1), F, "TENSOR_MISSING", "rewards"),
    C("rewards-nan", _tensors(0, lambda t: t["rewards"].__setitem__(0, np.nan)), F, "REWARDS_INVALID", "rewards"),
    C("rewards-wrong-shape", _tensors(0, lambda t: t.update(rewards=np.zeros(3, np.float32))), F,
      "TENSOR_SHAPE_MISMATCH", "rewards"),
    C("advantages-float16", _tensors(0, lambda t: t.update(advantages=t["advantages"].astype(np.float16))), F,
      "TENSOR_DTYPE_INVALID", "advantages"),
    C("bitwise-round-count-lie", _bitwise(lambda d: (d["rounds"][1].update(element_count=d["rounds"][1][
        "element_count"] + 1), d.update(element_count=d["element_count"] + 1))), F, "BITWISE_FILE_DISAGREES",
      "round 1 element_count"),
    C("bitwise-round-max-lie", _bw_round(0, max_abs_diff=1.0), F, "BITWISE_FILE_DISAGREES", "round 0 max_abs_diff",
      plan=PR_ATTN),
    C("bitwise-round-mean-lie", _bw_round(2, mean_abs_diff=0.5), F, "BITWISE_FILE_DISAGREES",
      "round 2 mean_abs_diff", plan=PR_ATTN),
    C("bitwise-total-mean-lie", _bitwise(lambda d: d.update(mean_abs_diff=0.5)), F, "BITWISE_FILE_DISAGREES",
      "mean_abs_diff", plan=PR_ATTN),
    C("bitwise-mismatches-hidden-consistently", _bitwise(lambda d: (
        d.update(mismatch_count=0, torch_equal=True), [r.update(mismatch_count=0) for r in d["rounds"]])), F,
      "BITWISE_FILE_DISAGREES", "mismatch_count", plan=PR_ATTN),
    C("bitwise-totals-do-not-add-up", lambda r, t: (_remove("train-data/round-0002.rank0.safetensors")(r, t),
                                                    _bitwise(lambda d: d.update(element_count=1))(r, t)), F,
      "BITWISE_FILE_DISAGREES", "add up"),
    C("bitwise-round-twice", _bitwise(lambda d: d["rounds"].append(dict(d["rounds"][0]))), F,
      "BITWISE_FILE_INVALID", "twice"),
    C("bitwise-round-beyond-run", _bitwise(lambda d: d["rounds"].append({**d["rounds"][0], "round": 9})), F,
      "BITWISE_FILE_DISAGREES", "claims round 9"),
    C("bitwise-round-omitted", _bitwise(lambda d: d["rounds"].pop()), F, "BITWISE_FILE_INVALID", "lacks"),
    C("readback-call-count-sum-lie", _set(_rb, lambda d: d["modules"]["ffn"].update(call_count=1000)), F,
      "READBACK_FIELD_INVALID", "sum to"),
    C("readback-module-backend-not-an-op", _set(_rb, lambda d: d["modules"]["ffn"].update(backend_id="rlk.cuda")),
      F, "READBACK_FIELD_INVALID", "not the backend of any"),
    # -- 3. type confusion ---------------------------------------------------------------------------
    C("metrics-mismatch-false", _round1(lambda r: r.update(mismatch_count=False)), F, "METRICS_INVALID",
      "mismatch_count"),
    C("metrics-round-string", _metrics(lambda rows: rows[0].update(round="0")), F, "METRICS_INVALID", "round"),
    C("metrics-reward-huge-int", _round1(lambda r: r.update(reward_mean=10**400)), F, "METRICS_INVALID",
      "reward_mean"),
    C("manifest-rounds-true", _manifest(lambda d: d.update(rounds=True)), F, "MANIFEST_FIELD_INVALID", "rounds"),
    C("manifest-rounds-float", _manifest(lambda d: d.update(rounds=3.0)), F, "MANIFEST_FIELD_INVALID", "rounds"),
    C("manifest-rounds-huge-int", _manifest(lambda d: d.update(rounds=10**400)), F, "MANIFEST_FIELD_INVALID",
      "rounds"),
    C("manifest-rounds-5000-digits", _raw("manifest.json", lambda s: s.replace('"rounds": 3', f'"rounds": {NINES}')),
      F, "JSON_INVALID", "manifest.json"),
    C("manifest-seed-string", _manifest(lambda d: d["seeds"].update(train="1234")), F, "MANIFEST_FIELD_INVALID",
      "seeds"),
    C("bitwise-max-huge-int", _bitwise(lambda d: d.update(max_abs_diff=10**400)), F, "BITWISE_FILE_INVALID",
      "max_abs_diff"),
    C("bitwise-max-overflowing-float", _raw("bitwise-validation.json",
                                            lambda s: s.replace('"max_abs_diff": 0.0', '"max_abs_diff": 1e999', 1)),
      F, "JSON_INVALID", "float range"),
    C("bitwise-torch-equal-int", _bitwise(lambda d: d.update(torch_equal=1)), F, "BITWISE_FILE_INVALID",
      "torch_equal"),
    C("bitwise-count-bool", _bitwise(lambda d: d.update(mismatch_count=False)), F, "BITWISE_FILE_INVALID",
      "mismatch_count"),
    C("metadata-round-superscript", _meta(round="\u00b2"), F, "TENSOR_METADATA_INVALID", "round"),
    C("metadata-round-5000-digits", _meta(round="0" * 5000), F, "TENSOR_METADATA_INVALID", "round"),
    C("readback-pid-bool", _set(_rb, lambda d: d.update(pid=True)), F, "READBACK_FIELD_INVALID", "pid"),
    C("readback-call-count-2-64", _set(_rb, _module_and_ops("ffn", call_count=2**64)), F,
      "READBACK_FIELD_INVALID", "call_count"),
    C("readback-fallback-string-false", _set(_rb, lambda d: d["modules"]["ffn"].update(fallback="false")), F,
      "READBACK_FIELD_INVALID", "fallback"),
    C("exit-code-5000-digits", _write("exit-code", "0" * 5000 + "\n"), F, "FILE_TOO_LARGE", "exit-code"),
    C("exit-code-long-number", _write("exit-code", "0" * 100 + "\n"), F, "EXIT_CODE_INVALID", "exit-code"),
    # -- 4. empty is not evidence --------------------------------------------------------------------
    C("bitwise-rounds-empty", _bitwise(lambda d: d.update(rounds=[])), F, "NOTHING_COMPARED", "0 round"),
    C("bitwise-zero-tokens-claimed", _bitwise(lambda d: d.update(element_count=0)), F, "NOTHING_COMPARED",
      "0 compared"),
    C("all-masks-empty", _all_tensors(lambda t: t["response_mask"].fill(0)), F, "NOTHING_COMPARED", "nothing"),
    C("zero-samples", _tensors(0, lambda t: t.update({k: v[:0] for k, v in t.items()})), F, "MASK_EMPTY",
      "round-0000"),
    C("r-side-op-production-backend", _set(_rb, _extra_ops("ffn", backend_id="production.torch", call_count=1)), F,
      "R_NOT_RLK", "production.torch"),
    C("r-side-op-foreign-backend", _set(_rb, _extra_ops("attention", backend_id="cuda.custom", call_count=1)), F,
      "R_NOT_RLK", "not an rlk backend"),
    C("r-side-op-no-contract", _set(_rb, _extra_ops("logp", contract_id=None, call_count=1)), F,
      "R_CONTRACT_MISSING", "logp.extra"),
    C("r-side-no-ops", _set(_rb, lambda d: d["modules"]["ffn"].update(ops={})), F, "READBACK_FIELD_INVALID",
      "records no op"),
    C("readback-unknown-module-fell-back", _set(_rb, lambda d: d["modules"].update(
        embedding={**d["modules"]["ffn"], "fallback": True})), F, "READBACK_FIELD_INVALID", "embedding"),
    C("metrics-empty-file", _write("metrics.jsonl", ""), I, "METRICS_MISSING", "3 round"),
    # -- 5. the seal is verifiable -------------------------------------------------------------------
    C("complete-hand-written", _write("COMPLETE", "sealed\n"), F, "SEAL_INVALID", "hand-written"),
    C("complete-empty", _write("COMPLETE", ""), F, "SEAL_INVALID", "empty"),
    C("complete-without-report", _write("COMPLETE", json.dumps({"schema": "rlk.complete.v1",
                                                                "run_validation_sha256": "0" * 64})), F,
      "SEAL_INVALID", "without its run-validation.json"),
    C("sealed-report-edited", _sealed_then(_edit_report), F, "SEAL_INVALID", "sha256 differs"),
    C("sealed-metrics-edited", _sealed_then(_edit_loss), F, "SEAL_INVALID", "metrics.jsonl"),
    C("sealed-readback-added", _sealed_then(_copy_readback(1001)), F, "SEAL_INVALID", "local-training-1001.json"),
    C("sealed-train-data-removed", _sealed_then(lambda r: (r / "train-data" / "round-0002.rank0.safetensors").unlink()),
      F, "COMPLETE_UNJUSTIFIED", "incomplete"),
    C("forged-seal-without-digests", _forged_seal({"schema": "rlk.run-validation.v1", "verdict": "passed"}), F,
      "SEAL_INVALID", "no input digests"),
    C("forged-seal-of-failed-report", _forged_seal({"schema": "rlk.run-validation.v1", "verdict": "failed"}), F,
      "SEAL_INVALID", "not passed"),
    # -- 7. bounded work on hostile sizes --------------------------------------------------------------
    C("manifest-claims-1e9-rounds", _manifest(lambda d: d.update(rounds=10**9)), I, "ROUNDS_MISSING", "999999997"),
    C("manifest-claims-1e9-ranks", _manifest(lambda d: d.update(ranks=10**9)), I, "ROUNDS_MISSING", "round 0 rank 1"),
    C("manifest-claims-1e13-rounds", _manifest(lambda d: d.update(rounds=10**13)), F, "MANIFEST_FIELD_INVALID",
      "rounds"),
    C("readback-nested-100", _set(_rb, lambda d: d["modules"]["ffn"]["ops"]["ffn.main"]["provenance"].update(
        x=_deep(100))), F, "JSON_INVALID", "nested deeper"),
    C("readback-fallback-reason-nested-900", _raw("readbacks/local-training-1000.json", lambda s: s.replace(
        '"fallback_reason": null', '"fallback_reason": ' + "[" * 900 + "]" * 900, 1)), F, "JSON_INVALID",
      "nested deeper"),
    C("metrics-line-nested-500", _write("metrics.jsonl", "[" * 500 + "]" * 500 + "\n"), F, "METRICS_INVALID",
      "nested deeper"),
    C("metrics-100k-bad-lines", _many_metrics_lines, F, "METRICS_INVALID", "more malformed lines"),
    C("bitwise-100k-phantom-rounds", _bitwise(_many_bitwise_rounds), F, "BITWISE_FILE_DISAGREES",
      "more malformed rounds"),
]


def test_hostile_suite_is_large_and_distinct() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_hostile_run(case: Case, tmp_path: Path, cli) -> None:
    run_case(case, tmp_path, cli)


# -- 6. matrix provenance ------------------------------------------------------------------------------
def _cell_manifest(cell: str, fn):
    return lambda root: mutate_json(root / cell / "manifest.json", fn)


def _ffn_env(d: dict) -> None:
    d["config"].update(env={"RL_KERNEL_FFN_CASE": "P/R"})


MATRIX_CASES = [
    ("cell-from-another-commit", _cell_manifest("ffn-PR", lambda d: d["repos"][0].update(sha="f" * 40)), F,
     "MATRIX_PROVENANCE_MISMATCH", "repos"),
    ("cell-other-seeds", _cell_manifest("logp-RP", lambda d: d["seeds"].update(train=7)), F,
     "MATRIX_PROVENANCE_MISMATCH", "seeds"),
    ("cell-other-config", _cell_manifest("attention-PP", lambda d: d["config"].update(lr=0.5)), F,
     "MATRIX_PROVENANCE_MISMATCH", "config.lr"),
    ("cell-other-inputs", _cell_manifest("ffn-RP", lambda d: d["inputs"].update(prompts="sha256:" + "cd" * 32)), F,
     "MATRIX_PROVENANCE_MISMATCH", "inputs"),
    ("cell-other-rounds", _cell_manifest("ffn-PP", lambda d: d["config"].update(rounds=9)), F,
     "MATRIX_PROVENANCE_MISMATCH", "config.rounds"),
    ("cell-routes-differ-only", _cell_manifest("ffn-PR", _ffn_env),
     P, None, None),
    # what the engines report at start-up (attention backend, rlk layer counts, start time) follows from the
    # routes or is a measurement: `runtime` is not compared (cell-other-config shows `config` is)
    ("cell-runtime-differs-only", _cell_manifest("attention-RP", lambda d: d.update(
        runtime={"vllm": {"attention_backend_config": "AttentionBackendEnum.FLASH_ATTN", "engine_start_s": 33.5},
                 "megatron_rlk_layers": {"attention": 0, "ffn": 112, "logp": 2}})),
     P, None, None),
    ("cell-name-lookalike", lambda root: shutil.copytree(root / "ffn-PR", root / "ffn-pr"), P,
     "MATRIX_UNKNOWN_ENTRY", "ffn-pr"),
]


@pytest.mark.parametrize(("name", "mutate", "verdict", "code", "needle"), MATRIX_CASES,
                         ids=[c[0] for c in MATRIX_CASES])
def test_hostile_matrix(name, mutate, verdict, code, needle, tmp_path: Path, cli) -> None:
    root = build_matrix(tmp_path / "m", rounds=1)
    for cell in root.iterdir():
        mutate_json(cell / "manifest.json", lambda d: d.update(config={"lr": 1e-3, "rounds": 1, "env": {}}))
    mutate(root)
    before = tree_state(root)
    res = cli("matrix", root)
    assert tree_state(root) == before, "plain `rlk-validate matrix` wrote into the root"
    assert res.code == {"passed": 0, "failed": 1}[verdict], res.out
    assert "Traceback" not in res.out + res.err
    if code:
        hits = res.findings(code)
        assert hits and any(needle in f["message"] for f in hits), res.out


def test_matrix_writes_only_where_asked_and_only_into_a_matrix_root(tmp_path: Path, cli) -> None:
    run = build_run(tmp_path / "run")
    before = tree_state(run)
    res = cli("matrix", run, "--write")
    assert res.code == 3 and "not a matrix root" in res.out and "rlk-validate DIR" in res.out
    assert tree_state(run) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("matrix", empty, "--write").code == 3 and list(empty.iterdir()) == []
    root = build_matrix(tmp_path / "m", ("control-RR",), rounds=1)
    assert cli("matrix", root, "--allow-partial").code == 0
    assert not (root / "matrix-report.json").exists()
    assert cli("matrix", root, "--allow-partial", "--write").code == 0
    assert (root / "matrix-report.json").exists() and (root / "matrix-report.md").exists()


def test_plain_validation_of_a_non_run_directory_says_so_in_one_line(tmp_path: Path, cli) -> None:
    root = build_matrix(tmp_path / "m", ("control-RR",), rounds=1)
    res = cli(root)
    assert res.code == 3 and len(res.out.strip().splitlines()) == 1
    assert f"rlk-validate matrix {root}" in res.out
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    res = cli(other)
    assert res.code == 3 and len(res.out.strip().splitlines()) == 1
    assert "not a run directory" in res.out and "rlk-validate matrix" in res.out
    assert res.codes == ["INPUT_UNUSABLE"]


@pytest.mark.parametrize(
    "argv", [["--bogus"], ["--bogus", "x"], ["matrix", "--bogus", "x"], ["x", "--seal=1x", "--nope=3"]]
)
def test_unknown_option_is_named(argv, capsys) -> None:
    from rlk_validate.cli import main

    assert main(argv) == 3
    err = capsys.readouterr().err
    bad = next(a for a in argv if a.startswith("--") and a.split("=")[0] not in ("--seal",))
    assert f"unknown option {bad}" in err, err


def test_abbreviated_options_are_not_guessed(capsys) -> None:
    from rlk_validate.cli import main

    assert main(["x", "--req"]) == 3
    assert "unknown option --req" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys) -> None:
    from rlk_validate.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "rlk-validate matrix MATRIX_ROOT" in out and "rlk-validate codes" in out and "[run] RUN_DIR" in out
