"""``rlk-repro run --trace`` end to end on the CPU (rlk_repro.trace -> kernel-trace.json -> rlk-validate's kernel-trace
gate): on a CPU the units are operator events, so an R/R round shows rlk's ops and a P/P round the vendor ones."""

from __future__ import annotations

import json
import shutil

import pytest

from rlk_core.plan import RoutePlan
from rlk_repro import cli
from rlk_repro.engine.local import run_local
from rlk_validate.kernel_trace import KERNEL_TRACE, REQUIRED_FAMILIES
from rlk_validate.validate import validate_run

SMALL = dict(rounds=2, prompts_per_round=1, samples_per_prompt=2, max_new_tokens=4)


@pytest.fixture(scope="module")
def traced(tmp_path_factory, small_config):
    out = tmp_path_factory.mktemp("traced")
    return {name: run_local(small_config(RoutePlan(c, c, c), trace=True, **SMALL), out / name).run_dir
            for name, c in (("rr", "R/R"), ("pp", "P/P"))}


def _families(run_dir) -> dict[str, dict[str, int]]:
    doc = json.loads((run_dir / KERNEL_TRACE).read_text())
    assert doc["round"] == 0 and doc["device"] == "cpu" and doc["units"] == "cpu operators"
    return {side: doc["sides"][side]["families"] for side in ("rollout", "train")}


def _codes(run_dir) -> list[str]:
    return [f.code for f in validate_run(run_dir).findings]


def test_rr_round_runs_every_rlk_family_and_no_vendor_one(traced):
    fam = _families(traced["rr"])
    for family in REQUIRED_FAMILIES[:-1]:  # no collective at TP 1
        assert fam["rollout"].get(family, 0) + fam["train"].get(family, 0) > 0, (family, fam)
    assert fam["train"]["attention_bwd"] > 0 and fam["rollout"]["gemm"] > 0
    for side in fam.values():
        assert not {"vendor_gemm", "vendor_attention", "vendor_allreduce"} & set(side), fam
    codes = _codes(traced["rr"])
    assert "KERNEL_TRACE_SUMMARY" in codes and "VENDOR_KERNEL_IN_R" not in codes
    assert "KERNEL_FAMILY_MISSING" not in codes


def test_pp_round_runs_vendor_kernels(traced):
    """The negative control: the same round under P/P runs the vendor GEMM and attention, and no rlk op."""
    fam = _families(traced["pp"])
    assert fam["rollout"]["vendor_gemm"] > 0 and fam["train"]["vendor_gemm"] > 0
    assert fam["train"]["vendor_attention"] > 0
    assert not set(fam["train"]) & set(REQUIRED_FAMILIES)


def test_an_rr_run_whose_trace_shows_vendor_kernels_fails(traced, tmp_path):
    """The R/R run directory with the P/P round's trace in place of its own: rlk-validate fails it."""
    run = tmp_path / "rr"
    shutil.copytree(traced["rr"], run)
    shutil.copyfile(traced["pp"] / KERNEL_TRACE, run / KERNEL_TRACE)
    codes = _codes(run)
    assert "VENDOR_KERNEL_IN_R" in codes and "KERNEL_FAMILY_MISSING" in codes, codes


def test_trace_asked_for_and_removed_is_incomplete(traced, tmp_path):
    run = tmp_path / "rr"
    shutil.copytree(traced["rr"], run)
    (run / KERNEL_TRACE).unlink()
    report = validate_run(run)
    assert "KERNEL_TRACE_MISSING" in [f.code for f in report.findings] and report.verdict != "passed"


def test_cli_trace_flag_reaches_the_config(tmp_path):
    a = cli.build_parser().parse_args(["run", "--trace"])
    assert a.trace is True and cli.build_parser().parse_args(["run"]).trace is False
