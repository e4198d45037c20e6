"""What the backward companion ops (``rms_norm_backward``, ``swiglu_backward``, ``rope_backward``) must do in
the registry, checked alike for each op by its test file: registered for ``rlk.reference`` (CPU, CUDA) and
``rlk.triton`` (CUDA), reported to the readback like a forward op when autograd runs them, and forced with
their main op by ``RLK_BACKENDS``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlk_core import routes
from rlk_core.contracts import COMPANION_OF, OP_CONTRACTS
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder


def check_registered(registry, op: str) -> None:
    backward = f"{op}_backward"
    assert COMPANION_OF[backward] == op and OP_CONTRACTS[backward] == OP_CONTRACTS[op]
    assert routes.BACKWARD_OPS[op] == backward
    backends = {b.id: b for b in registry.backends(backward)}
    assert set(backends) >= {"rlk.reference", "rlk.triton"}
    assert backends["rlk.reference"].devices == ("cpu", "cuda") and backends["rlk.triton"].devices == ("cuda",)
    assert backends["rlk.triton"].plan == f"rlk_core.ops.{op}.triton:backward"


def check_reported(op: str, module: str, fwd_bwd: Callable[[], object]) -> None:
    """``fwd_bwd()`` (a forward and a backward through the public op) inside ``module``'s scope records the
    backward op with its backend and contract, on the train side."""
    plan = RoutePlan("R/R", "R/R", "R/R")
    rec = ReadbackRecorder("local", "train", plan)
    with rec.scope(module):
        fwd_bwd()
    seen = rec.to_dict()["modules"][module]["ops"]
    got = seen[f"{op}_backward"]
    assert got["backend_id"] == "rlk.reference" and got["contract_id"] == OP_CONTRACTS[op]
    assert got["call_count"] == 1 and got["fallback"] is False
    assert seen[op]["call_count"] == 1


def check_forced_with_the_main_op(registry, monkeypatch, op: str, fwd_bwd: Callable[[], tuple]) -> None:
    """A backend forced for ``op`` runs its backward too: a twin of the reference registered at a low
    priority runs both once forced (a spy counts its backward calls), and the gradients are the reference's;
    without the override the reference runs (the control)."""
    from rlk_core.backends import Backend

    calls: list[str] = []
    for name in (op, f"{op}_backward"):
        ref = registry.get(name, "rlk.reference").fn
        registry.register(Backend("acme.twin", name, lambda *a, _r=ref, _n=name: calls.append(_n) or _r(*a),
                                  devices=("cpu",), priority=-5, builtin=True))
    registry.refresh()
    want = fwd_bwd()
    assert calls == []
    monkeypatch.setenv("RLK_BACKENDS", f"{op}=acme.twin")
    registry.refresh()
    got = fwd_bwd()
    assert calls == [op, f"{op}_backward"]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def check_suite_refuses_broken_backwards(op: str) -> None:
    """The contract suite of ``<op>_backward`` passes the reference and refuses a dx that depends on the batch
    size (batch invariance), one that drifts between calls (run to run) and one scaled by 1 % (matches
    reference) — each failing the check meant for it."""
    from rlk_core.backends import REGISTRY
    from rlk_core.testing.contracts import SUITES, Subject, run_check

    name = f"{op}_backward"
    ref = REGISTRY.get(name, "rlk.reference").fn
    calls = []

    def scaled(factor):
        def fn(*args):
            out = ref(*args)
            f = factor(args[0])
            return (out[0] * f, *out[1:]) if isinstance(out, tuple) else out * f
        return fn

    broken = {"dx_batch_invariance": scaled(lambda g: 1 + 1e-2 * g.shape[0]),
              "run_to_run": scaled(lambda g: calls.append(1) or 1 + 1e-3 * len(calls)),
              "matches_reference": scaled(lambda g: 1.01)}
    checks = {c.name: c for c in SUITES[name]}
    assert set(checks) == set(broken)
    fns = {n: REGISTRY.get(n, "rlk.reference").fn for n in SUITES}
    for check in checks.values():
        subject = Subject(name, {**fns, name: ref}, {n: "acme.test" for n in fns})
        ok, why = run_check(check, subject, "cpu")
        assert ok, why
        subject = Subject(name, {**fns, name: broken[check.name]}, {n: "acme.test" for n in fns})
        ok, why = run_check(check, subject, "cpu")
        assert not ok, (check.name, why)
