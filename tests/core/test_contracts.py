"""The contract suite (``rlk_core.testing.contracts``) on the CPU: every check of every op passes for what
rlk dispatches here, and each kind of check refuses an implementation that breaks it. rlk-selfcheck and
backend qualification run the same checks (tests/core/test_selfcheck.py, tests/core/test_qualify.py)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

import rlk_core.ops  # noqa: F401  (registers the built-in backends)
from rlk_core.backends import REGISTRY
from rlk_core.testing.contracts import SELFCHECK_OPS, SUITES, Subject, checks, dispatched, run_check

CASES = [(op, c) for op in SELFCHECK_OPS for c in SUITES[op] if c.applies is None]


@pytest.mark.parametrize("op,check", CASES, ids=[f"{op}-{c.name}" for op, c in CASES])
def test_check_passes_for_the_dispatched_ops(op, check):
    ok, why = run_check(check, dispatched(op, "cpu"), "cpu")
    assert ok, why


def test_selfcheck_runs_every_suite_once():
    from rlk_core.contracts import OP_CONTRACTS

    assert set(SUITES) <= set(OP_CONTRACTS)
    assert {id(s) for s in SUITES.values()} == {id(SUITES[op]) for op in SELFCHECK_OPS}
    assert len({id(SUITES[op]) for op in SELFCHECK_OPS}) == len(SELFCHECK_OPS)


def _subject(op, fn, backend_id="acme.test"):
    fns = {name: REGISTRY.get(name, "rlk.reference").fn for name in SUITES}
    return Subject(op, {**fns, op: fn}, {name: backend_id for name in fns})


def _results(subject):
    return {c.name: run_check(c, subject, "cpu") for c in checks(subject, "cpu")}


def test_a_batch_dependent_linear_fails_batch_invariance_only():
    ref = REGISTRY.get("linear", "rlk.reference").fn
    res = _results(_subject("linear", lambda x, w, b: ref(x, w, b) + 1e-2 * x.shape[0]))
    assert not res["batch_invariance"][0] and "row alone" in res["batch_invariance"][1]
    assert res["run_to_run"][0] and "backward_run_to_run" not in res  # rlk's own autograd: dispatched only


def test_a_blas_linear_fails_batch_invariance_on_this_cpu():
    res = _results(_subject("linear", lambda x, w, b: F.linear(x, w, b)))
    assert not res["batch_invariance"][0], res["batch_invariance"]


def test_a_drifting_op_fails_run_to_run():
    calls = []

    def drifting(x, w, eps):
        calls.append(1)
        return REGISTRY.get("rms_norm", "rlk.reference").fn(x, w, eps) + len(calls) * 1e-3

    res = _results(_subject("rms_norm", drifting))
    assert not res["run_to_run"][0] and "repeat" in res["run_to_run"][1]


def test_an_inaccurate_op_fails_matches_reference():
    ref = REGISTRY.get("swiglu", "rlk.reference").fn
    res = _results(_subject("swiglu", lambda x: ref(x) * 1.01))
    assert not res["matches_reference"][0] and "relative error" in res["matches_reference"][1]
    assert res["batch_invariance"][0] and res["run_to_run"][0]


def test_a_rope_that_ignores_positions_fails_offset_invariance():
    ref = REGISTRY.get("rope", "rlk.reference").fn
    res = _results(_subject("rope", lambda x, p, theta, rd: ref(x, p - p.min(), theta, rd)))
    assert not res["offset_invariance"][0], res["offset_invariance"]


def test_a_failing_check_reports_an_exception_as_its_reason():
    def broken(*args):
        raise RuntimeError("kernel exploded")

    res = _results(_subject("kv_cache_write", broken))
    assert res["exact_write"] == (False, "raised RuntimeError: kernel exploded")


def test_the_reference_is_not_compared_with_itself():
    names = [c.name for c in checks(dispatched("linear", "cpu"), "cpu")]
    assert "matches_reference" not in names and "batch_invariance" in names
    assert "every_tile_same_bits" not in names  # only where rlk.triton runs the GEMM on a GPU
