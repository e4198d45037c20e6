"""The broken-input corpus: every case gets the right verdict and finding code, a clear message,
no traceback, and leaves the input tree exactly as it was."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from validate_builders import PP, build_run, mutate_json, read_json, write_json
from validate_mutations import (
    PR_ATTN,
    Case,
    _bitwise_liar,
    _chmod000,
    _complete_on_failure,
    _dup_readback,
    _extra_round,
    _fifo,
    _legacy_pt,
    _metrics_drop,
    _metrics_lie,
    _metrics_line,
    _module_and_ops,
    _nested_fallback,
    _plan_mismatch,
    _poke,
    _rb,
    _remove,
    _set,
    _sparse,
    _symlink_dir_out,
    _symlink_out,
    _tensors,
    _truncate,
    _ulp_flip,
    _write,
    run_case,
)

from rlk_validate.tensors import torch_importable

C = Case
CASES = [
    C("manifest-truncated", _truncate("manifest.json"), "failed", "JSON_INVALID", "truncated"),
    C(
        "manifest-garbage",
        _write("manifest.json", "{this is not json"),
        "failed",
        "JSON_INVALID",
        "manifest.json",
    ),
    C("manifest-empty", _write("manifest.json", ""), "failed", "JSON_INVALID", "manifest.json"),
    C(
        "manifest-nan",
        _write("manifest.json", '{"schema": "rlk.manifest.v1", "rounds": NaN}'),
        "failed",
        "JSON_INVALID",
        "NaN",
    ),
    C(
        "manifest-duplicate-key",
        _write("manifest.json", '{"schema": "rlk.manifest.v1", "schema": "x"}'),
        "failed",
        "JSON_INVALID",
        "duplicate",
    ),
    C(
        "manifest-schema-v2",
        _set(lambda r: r / "manifest.json", lambda d: d.update(schema="rlk.manifest.v2")),
        "failed",
        "SCHEMA_UNSUPPORTED",
        "rlk.manifest.v2",
    ),
    C("manifest-missing", _remove("manifest.json"), "incomplete", "MANIFEST_MISSING", "manifest.json"),
    C(
        "manifest-no-sha",
        _set(lambda r: r / "manifest.json", lambda d: d["repos"][0].update(sha="abc")),
        "failed",
        "MANIFEST_FIELD_INVALID",
        "sha",
    ),
    C(
        "manifest-no-dirty",
        _set(lambda r: r / "manifest.json", lambda d: d["repos"][0].pop("dirty")),
        "incomplete",
        "REPO_REVISION_UNKNOWN",
        "dirty state",
    ),
    C(
        "manifest-not-a-git-checkout",
        _set(
            lambda r: r / "manifest.json",
            lambda d: d["repos"][0].update(sha=None, dirty=None, error="not a git checkout"),
        ),
        "incomplete",
        "REPO_REVISION_UNKNOWN",
        "not a git checkout",
    ),
    C(
        "manifest-dirty-not-bool",
        _set(lambda r: r / "manifest.json", lambda d: d["repos"][0].update(dirty="yes")),
        "failed",
        "MANIFEST_FIELD_INVALID",
        "dirty",
    ),
    C(
        "manifest-no-inputs",
        _set(lambda r: r / "manifest.json", lambda d: d.pop("inputs")),
        "failed",
        "MANIFEST_FIELD_MISSING",
        "inputs",
    ),
    C(
        "manifest-bad-plan",
        _set(lambda r: r / "manifest.json", lambda d: d["plan"].update(ffn="R/Q")),
        "failed",
        "PLAN_INVALID",
        "ffn",
    ),
    C(
        "mode-consistency-mixed",
        _set(lambda r: r / "manifest.json", lambda d: d.update(mode="consistency")),
        "failed",
        "MODE_PLAN_MISMATCH",
        "consistency",
        plan=PR_ATTN,
    ),
    C("exit-code-missing", _remove("exit-code"), "incomplete", "EXIT_CODE_MISSING", "exit-code"),
    C("exit-code-nonzero", _write("exit-code", "137\n"), "failed", "EXIT_CODE_NONZERO", "137"),
    C("exit-code-garbage", _write("exit-code", "banana\n"), "failed", "EXIT_CODE_INVALID", "banana"),
    C(
        "traceback-in-log",
        _write("run.log", "ok\nTraceback (most recent call last):\n  File x\nValueError: boom\n"),
        "failed",
        "TRACEBACK_IN_LOG",
        "line 2",
    ),
    C("run-log-missing", _remove("run.log"), "incomplete", "RUN_LOG_MISSING", "run.log"),
    C(
        "readback-truncated",
        _truncate("readbacks/local-training-1000.json"),
        "failed",
        "JSON_INVALID",
        "local-training-1000.json",
    ),
    C(
        "readback-not-utf8",
        _write("readbacks/local-training-1000.json", b"\xff\xfe{}"),
        "failed",
        "JSON_INVALID",
        "UTF-8",
    ),
    C(
        "readback-deeply-nested",
        _write("readbacks/local-training-1000.json", "[" * 200000 + "]" * 200000),
        "failed",
        "JSON_INVALID",
        "local-training-1000.json",
    ),
    C(
        "readback-schema-v2",
        _set(_rb, lambda d: d.update(schema="rlk.readback.v2")),
        "failed",
        "SCHEMA_UNSUPPORTED",
        "rlk.readback.v2",
    ),
    C(
        "readback-is-array",
        _write("readbacks/local-training-1000.json", "[]"),
        "failed",
        "SCHEMA_UNSUPPORTED",
        "local-training-1000.json",
    ),
    C(
        "readbacks-rollout-side-missing",
        _remove("readbacks/local-rollout-1000.json"),
        "incomplete",
        "READBACKS_MISSING",
        "rollout side",
    ),
    C("readbacks-dir-missing", _remove("readbacks"), "incomplete", "READBACKS_MISSING", "readbacks/"),
    C("fallback-nested-provenance", _set(_rb, _nested_fallback), "failed", "FALLBACK", "provenance.fallback"),
    C(
        "fallback-in-op",
        _set(_rb, lambda d: d["modules"]["logp"]["ops"]["logp.main"].update(fallback=True)),
        "failed",
        "FALLBACK",
        "logp.main.fallback",
    ),
    C(
        "backend-diverges",
        _set(_rb, _module_and_ops("ffn", backend_id="rlk.triton")),
        "failed",
        "BACKEND_DIVERGES",
        "'ffn.main' ran ['rlk.triton'] on the train side",
    ),
    C(
        "fallback-count",
        _set(_rb, lambda d: d["modules"]["attention"].update(fallback_count=3)),
        "failed",
        "FALLBACK",
        "fallback_count",
    ),
    C(
        "p-side-claims-rlk-backend",
        _set(_rb, _module_and_ops("attention", backend_id="rlk.triton")),
        "failed",
        "P_REPORTS_RLK",
        "rlk.triton",
        plan=PR_ATTN,
    ),
    C(
        "p-side-inner-provenance-rlk",
        _set(
            _rb,
            lambda d: d["modules"]["attention"]["ops"]["attention.main"]["provenance"].update(backend_id="rlk.cuda"),
        ),
        "failed",
        "P_REPORTS_RLK",
        "provenance.backend_id",
        plan=PR_ATTN,
    ),
    C(
        "p-side-implementation-rlk",
        _set(_rb, lambda d: d["modules"]["attention"].update(implementation="rlk")),
        "failed",
        "P_NOT_PRODUCTION",
        "implementation",
        plan=PR_ATTN,
    ),
    C(
        "r-side-production",
        _set(_rb, _module_and_ops("ffn", implementation="production", backend_id="production.torch")),
        "failed",
        "R_NOT_RLK",
        "production",
    ),
    C(
        "r-side-no-contract",
        _set(_rb, lambda d: d["modules"]["ffn"].update(contract_id=None)),
        "failed",
        "R_CONTRACT_MISSING",
        "contract_id",
    ),
    C(
        "module-never-called",
        _set(_rb, _module_and_ops("logp", call_count=0)),
        "failed",
        "MODULE_NOT_EXECUTED",
        "logp",
    ),
    C(
        "module-record-missing",
        _set(_rb, lambda d: d["modules"].pop("ffn")),
        "failed",
        "MODULE_RECORD_MISSING",
        "ffn",
    ),
    C(
        "case-mismatch",
        _set(_rb, lambda d: d["modules"]["ffn"].update(case="P")),
        "failed",
        "CASE_MISMATCH",
        "ffn",
    ),
    C("readback-plan-mismatch", _set(_rb, _plan_mismatch), "failed", "READBACK_PLAN_MISMATCH", "requested"),
    C("readback-duplicate", _dup_readback, "failed", "READBACK_DUPLICATE", "pid 1000"),
    C(
        "readback-misnamed",
        _set(_rb, lambda d: d.update(pid=1234)),
        "failed",
        "READBACK_NAME_MISMATCH",
        "local-training-1234.json",
    ),
    C(
        "readback-other-run",
        _set(_rb, lambda d: d.update(run_id="another-run")),
        "failed",
        "READBACK_RUN_ID_MISMATCH",
        "another-run",
    ),
    C(
        "readback-bad-rank",
        _set(_rb, lambda d: d.update(rank=3)),
        "failed",
        "READBACK_FIELD_INVALID",
        "rank 3",
    ),
    C("logprob-nan", _tensors(1, _poke("train_logprobs", np.nan)), "failed", "LOGPROB_NONFINITE", "NaN"),
    C(
        "logprob-inf",
        _tensors(2, _poke("rollout_logprobs", -np.inf)),
        "failed",
        "LOGPROB_NONFINITE",
        "round-0002",
    ),
    C("logprob-train-outside-kept", _tensors(1, _poke("train_logprobs", -np.inf)), "failed",
      "TRAIN_LOGPROB_OUTSIDE_KEPT_SET", "outside the trainer's own kept set"),
    C("logprob-positive", _tensors(0, _poke("train_logprobs", 0.5)), "failed", "LOGPROB_POSITIVE", "> 0"),
    C(
        "shape-mismatch",
        _tensors(0, lambda t: t.update(train_logprobs=t["train_logprobs"][:, :-1].copy())),
        "failed",
        "TENSOR_SHAPE_MISMATCH",
        "train_logprobs",
    ),
    C("mask-empty", _tensors(1, lambda t: t["response_mask"].fill(0)), "failed", "MASK_EMPTY", "round-0001"),
    C(
        "mask-not-binary",
        _tensors(0, lambda t: t["response_mask"].__setitem__((0, 0), 2)),
        "failed",
        "MASK_INVALID",
        "response_mask",
    ),
    C(
        "logprob-float16",
        _tensors(0, lambda t: t.update(train_logprobs=t["train_logprobs"].astype(np.float16))),
        "failed",
        "TENSOR_DTYPE_INVALID",
        "F16",
    ),
    C(
        "tensor-missing",
        _tensors(0, lambda t: t.pop("rollout_logprobs")),
        "failed",
        "TENSOR_MISSING",
        "rollout_logprobs",
    ),
    C(
        "safetensors-truncated",
        _truncate("train-data/round-0001.rank0.safetensors", 0.7),
        "failed",
        "TENSOR_FILE_INVALID",
        "round-0001",
    ),
    C(
        "safetensors-garbage",
        _write("train-data/round-0001.rank0.safetensors", b"\x00" * 3),
        "failed",
        "TENSOR_FILE_INVALID",
        "too short",
    ),
    C(
        "metadata-wrong-round",
        _tensors(0, lambda t: None, {"schema": "rlk.train-data.v1", "round": "5", "rank": "0"}),
        "failed",
        "TENSOR_METADATA_INVALID",
        "round",
    ),
    C("rr-one-ulp", _tensors(1, _ulp_flip), "failed", "BITWISE_MISMATCH", "1 of"),
    C(
        "round-missing",
        _remove("train-data/round-0002.rank0.safetensors"),
        "incomplete",
        "ROUNDS_MISSING",
        "round 2 rank 0",
    ),
    C("round-extra", _extra_round, "failed", "TRAIN_DATA_UNEXPECTED", "round 3"),
    C("train-data-missing", _remove("train-data"), "incomplete", "TRAIN_DATA_MISSING", "train-data"),
    C(
        "symlink-readback-outside",
        _symlink_out("readbacks/vllm-rollout-5.json"),
        "failed",
        "PATH_ESCAPES",
        "outside",
    ),
    C("symlink-train-data-outside", _symlink_dir_out, "failed", "PATH_ESCAPES", "train-data"),
    C(
        "symlink-manifest-outside",
        lambda r, t: (os.unlink(r / "manifest.json"), _symlink_out("manifest.json", "m.json")(r, t)),
        "failed",
        "PATH_ESCAPES",
        "manifest.json",
    ),
    C(
        "huge-readback",
        _sparse("readbacks/local-training-1000.json", (64 << 20) + 1),
        "failed",
        "FILE_TOO_LARGE",
        "cap",
    ),
    C(
        "huge-train-data",
        _sparse("train-data/round-0000.rank0.safetensors", 3 << 20),
        "failed",
        "FILE_TOO_LARGE",
        "round-0000",
        args=("--max-tensor-mib", "2"),
    ),
    C("huge-exit-code", _sparse("exit-code", 1 << 20), "failed", "FILE_TOO_LARGE", "exit-code"),
    C("fifo-readback", _fifo, "failed", "NOT_A_FILE", "vllm-rollout-77.json"),
    C(
        "directory-as-readback",
        lambda r, t: (r / "readbacks" / "vllm-rollout-9.json").mkdir(),
        "failed",
        "NOT_A_FILE",
        "vllm-rollout-9.json",
    ),
    C(
        "unreadable-readback",
        _chmod000("readbacks/local-rollout-1000.json"),
        "failed",
        "FILE_UNREADABLE",
        "local-rollout-1000.json",
        marks=[pytest.mark.skipif(os.geteuid() == 0, reason="root reads mode-000 files")],
    ),
    C(
        "bitwise-file-lies",
        _set(lambda r: r / "bitwise-validation.json", _bitwise_liar),
        "failed",
        "BITWISE_FILE_DISAGREES",
        "element_count",
    ),
    C(
        "bitwise-file-fallback-failures",
        _set(lambda r: r / "bitwise-validation.json", lambda d: d.update(fallback_failures=2)),
        "failed",
        "FALLBACK_FAILURES",
        "2 fallback",
    ),
    C(
        "bitwise-file-missing",
        _remove("bitwise-validation.json"),
        "incomplete",
        "BITWISE_FILE_MISSING",
        "bitwise-validation.json",
    ),
    C(
        "bitwise-file-no-fields",
        _write("bitwise-validation.json", '{"schema": "rlk.bitwise-validation.v1"}'),
        "failed",
        "BITWISE_FILE_INVALID",
        "mismatch_count",
    ),
    C("metrics-truncated-line", _metrics_line, "failed", "METRICS_INVALID", "line 3"),
    C("metrics-disagree", _metrics_lie, "failed", "METRICS_DISAGREE", "compared_tokens"),
    C("metrics-round-missing", _metrics_drop, "incomplete", "METRICS_MISSING", "[2]"),
    C("complete-on-failed-run", _complete_on_failure, "failed", "COMPLETE_UNJUSTIFIED", "COMPLETE"),
    C(
        "legacy-pt-without-torch",
        _legacy_pt,
        "incomplete",
        "LEGACY_PT_UNAVAILABLE",
        "torch",
        marks=[pytest.mark.skipif(torch_importable(), reason="torch is importable here")],
    ),
]


def test_corpus_is_large_enough():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_broken_run(case: Case, tmp_path: Path, cli) -> None:
    run_case(case, tmp_path, cli)


def test_unreadable_file_in_process(good_run: Path, cli, monkeypatch) -> None:
    """Mode-000 files cannot be simulated as root; fail the open itself instead."""
    from rlk_validate import safeio

    real_open = safeio._open_readonly

    def deny(path: str) -> int:
        if path.endswith("local-rollout-1000.json"):
            raise PermissionError(13, "Permission denied")
        return real_open(path)

    monkeypatch.setattr(safeio, "_open_readonly", deny)
    res = cli(good_run)
    assert res.code == 1
    [f] = res.findings("FILE_UNREADABLE")
    assert "Permission denied" in f["message"] and f["path"] == "readbacks/local-rollout-1000.json"


def test_symlink_inside_the_run_is_fine(good_run: Path, cli) -> None:
    os.rename(good_run / "run.log", good_run / "run.log.real")
    (good_run / "run.log").symlink_to("run.log.real")
    res = cli(good_run)
    assert res.code == 0, res.out


def test_readback_without_manifest_plan_conflict(good_run: Path, cli) -> None:
    (good_run / "manifest.json").unlink()
    mutate_json(_rb(good_run), _plan_mismatch)
    res = cli(good_run)
    assert res.code == 1
    assert res.findings("READBACK_PLAN_CONFLICT")
    assert read_json(_rb(good_run, "rollout"))["plan"]["ffn"] == "R/R"


def test_write_json_helper_roundtrip(tmp_path: Path) -> None:
    write_json(tmp_path / "x.json", {"a": 1})
    assert read_json(tmp_path / "x.json") == {"a": 1}


def test_a_native_run_outside_the_trainers_kept_set_is_drift_not_corrupt_data(tmp_path: Path, cli) -> None:
    """P/P under filters: a sampled token outside the trainer's own kept set has train log-prob -inf. That is the
    kept sets' disagreement (a warning); before, LOGPROB_NONFINITE failed every P/P filtered ladder rung on the
    H200. A NaN at the same place stays LOGPROB_NONFINITE (the negative control)."""
    for value, want, not_want in ((-np.inf, "TRAIN_LOGPROB_OUTSIDE_KEPT_SET", "LOGPROB_NONFINITE"),
                                  (np.nan, "LOGPROB_NONFINITE", "TRAIN_LOGPROB_OUTSIDE_KEPT_SET")):
        run = build_run(tmp_path / f"run-{value}", PP)
        _tensors(1, _poke("train_logprobs", value))(run, tmp_path)
        res = cli(run)
        assert want in res.codes and not_want not in res.codes, res.codes
        if want == "TRAIN_LOGPROB_OUTSIDE_KEPT_SET":
            assert res.findings(want)[0]["severity"] == "warning"
