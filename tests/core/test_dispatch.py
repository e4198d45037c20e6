"""Public ops skip the PyTorch dispatcher only when it has nothing to add; same implementation, same bits,
same readback either way."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rlk_core import ops
from rlk_core.ops import _dispatch as D
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.testing import assert_bitwise_equal

from ._modes import Spy as _Spy


def test_path_direct_only_when_the_dispatcher_has_nothing_to_add():
    x = torch.randn(3, 8)
    assert D._how((x, [x], None, 1.0)) == D.DIRECT
    leaf = x.clone().requires_grad_()
    assert D._how((leaf,)) == D.AUTOGRAD
    assert D._how((x, [leaf])) == D.DISPATCHER  # autograd.Function does not see tensors inside lists
    with torch.no_grad():
        assert D._how((leaf,)) == D._how((x, [leaf])) == D.DIRECT
    assert D._how((torch.nn.Parameter(x, requires_grad=False),)) == D.DIRECT
    with _Spy():
        assert D._how((x,)) == D._how((leaf,)) == D.DISPATCHER
    with FakeTensorMode() as mode:
        assert D._how((mode.from_tensor(x),)) == D.DISPATCHER


def test_path_scalars_and_their_subclasses_take_the_same_answers():
    """Arguments of an exact scalar type skip the isinstance tests; subclasses of scalars and of tuples
    (``torch.Size``, a named tuple holding a tensor) still take them."""
    x = torch.randn(3, 8)
    leaf = x.clone().requires_grad_()
    scalars = (None, True, 2, 1.5, "s", torch.float32, torch.device("cpu"), torch.contiguous_format, torch.strided)
    assert D._how((x, *scalars)) == D.DIRECT
    assert D._how((*scalars, leaf)) == D.AUTOGRAD
    assert D._how((x, x.shape)) == D.DIRECT  # torch.Size: a tuple of ints

    class Pair(tuple):
        pass

    assert D._how((x, Pair((x, 1)))) == D.DIRECT
    assert D._how((x, Pair((leaf, 1)))) == D.DISPATCHER
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert D._how((1.0, fake)) == D._how((x, Pair((fake,)))) == D.DISPATCHER
    with torch.no_grad():
        assert D._how((leaf, 1.0)) == D.DIRECT


def test_function_path_unwraps_dead_functorch_wrappers_as_function_apply_does():
    """A tensor that escaped a ``torch.func`` transform (a dead wrapper, of type ``torch.Tensor``) reaches the
    implementation unwrapped on the eager autograd path, as ``autograd.Function.apply`` passes it."""
    from rlk_core.backends import REGISTRY, Backend

    escaped, seen = [], []
    leaf = torch.randn(2, 8, requires_grad=True)
    torch.func.grad(lambda x: escaped.append(x * leaf) or (x * x).sum())(torch.randn(2, 8))
    dead = escaped[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead) and dead.requires_grad
    assert D._how((dead,)) == D.AUTOGRAD

    def spy(x):
        seen.append(torch._C._functorch.is_functorch_wrapped_tensor(x))
        return x.new_zeros(*x.shape[:-1], x.shape[-1] // 2)

    REGISTRY.register(Backend("test.spy", "swiglu", spy, devices=("cpu",), priority=1 << 20, builtin=True),
                      replace=True)
    REGISTRY.refresh()
    try:
        ops.swiglu(dead)
    finally:
        REGISTRY.unregister("swiglu", "test.spy")
        REGISTRY.refresh()
    assert seen == [False]


@pytest.mark.parametrize("strict", [False, True])
def test_export_traces_the_public_ops_as_operators(strict):
    """``torch.export`` (strict: Dynamo; non-strict: the compile flag and a dispatch mode, which ``_path``
    looks for instead of the flag) sees each public op as its ``torch.ops.rlk`` operator, trained or not."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return ops.swiglu(ops.rms_norm(x, self.w, 1e-6))

    graph = torch.export.export(Block(), (torch.randn(3, 16),), strict=strict).graph
    assert [str(n.target) for n in graph.nodes if n.op == "call_function"] == ["rlk.rms_norm.default",
                                                                               "rlk.swiglu.default"]


def _grads(fn, inputs, seed=0):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    return out, [t.grad for t in leaves]


def test_eager_autograd_function_matches_the_custom_op_autograd_bit_for_bit():
    """The eager path (an autograd.Function over the op's implementation) and the dispatcher path (the
    custom op's autograd) give the same outputs and gradients, and the eager one is what ops use."""
    x, w, b = torch.randn(6, 32), torch.randn(24, 32), torch.randn(24)
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cases = [
        (lambda *t: ops.linear(*t), lambda *t: torch.ops.rlk.linear(*t), (x, w, b)),
        (lambda t: ops.swiglu(t), lambda t: torch.ops.rlk.swiglu(t), (torch.randn(5, 48),)),
        (lambda q, k, v: ops.attention_varlen(q, k, v, cu, cu, 0.25),
         lambda q, k, v: torch.ops.rlk.attention_varlen(q, k, v, cu, cu, 0.25, True, None), (q, k, v)),
    ]
    for eager, dispatched, inputs in cases:
        out_e, grads_e = _grads(eager, inputs)
        out_d, grads_d = _grads(dispatched, inputs)
        assert_bitwise_equal(out_e, out_d)
        for a, b_ in zip(grads_e, grads_d, strict=True):
            assert_bitwise_equal(a, b_)
        leaves = [t.detach().requires_grad_() for t in inputs]
        assert type(eager(*leaves).grad_fn).__name__.endswith("_functionBackward")
        assert "function" not in type(dispatched(*leaves).grad_fn).__name__


def test_eager_autograd_function_supports_double_backward_where_the_op_did():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    y = ops.linear(x, w)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    gx.sum().backward()  # d/dw of sum(dy W) with dy = 1: every element of w.grad is M = 3
    assert torch.equal(w.grad, torch.full_like(w, 3.0))


def test_direct_and_dispatched_calls_agree_and_are_recorded():
    x, w = torch.randn(5, 64), torch.randn(24, 64)
    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"))
    with torch.no_grad(), rec.scope("ffn"):
        direct = ops.swiglu(ops.linear(x, w))
    dispatched = torch.ops.rlk.swiglu(torch.ops.rlk.linear(x, w, None))
    assert_bitwise_equal(direct, dispatched)
    ffn = rec.to_dict()["modules"]["ffn"]
    assert ffn["ops"]["linear"]["call_count"] == 1 and ffn["ops"]["swiglu"]["call_count"] == 1


def test_autograd_and_dispatch_modes_still_see_the_custom_op():
    x = torch.randn(4, 16, requires_grad=True)
    y = ops.swiglu(x)
    assert y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    spy = _Spy()
    with torch.no_grad(), spy:
        ops.swiglu(torch.randn(2, 16))
    assert any("rlk.swiglu" in name for name in spy.ops), spy.ops[:5]


def test_a_public_op_under_a_dispatch_mode_goes_through_the_dispatcher_and_reports_its_backend():
    x, w = torch.randn(4, 16), torch.randn(6, 16)
    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="strict")
    spy = _Spy()
    with rec.scope("ffn"), spy:
        got = ops.swiglu(ops.linear(x, w))
    assert spy.ops == ["rlk.linear.default", "rlk.swiglu.default"]
    assert_bitwise_equal(got, ops.swiglu(ops.linear(x, w)))
    seen = rec.to_dict()["modules"]["ffn"]["ops"]
    for op in ("linear", "swiglu"):
        assert (seen[op]["backend_id"], seen[op]["call_count"], seen[op]["fallback"]) == ("rlk.reference", 1, False)


def test_eager_autograd_applies_the_function_without_binding_its_signature(monkeypatch):
    """``Function.apply`` binds the arguments to the forward's signature (``inspect.signature``) on every call;
    the eager path applies the same Function without that step (all arguments are positional, none defaulted) —
    same graph node, outputs and gradients — and leaves the full ``apply`` to functorch transforms."""
    import inspect

    x, w = torch.randn(3, 8), torch.randn(5, 8)
    want_out, want_grads = _grads(lambda *t: D.op("linear").function.apply(*t, None), (x, w))
    signatures = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: signatures.append(a) or real(*a, **k))
    out, grads = _grads(lambda *t: ops.linear(*t), (x, w))
    assert signatures == []
    assert_bitwise_equal(out, want_out)
    for a, b in zip(grads, want_grads, strict=True):
        assert_bitwise_equal(a, b)
    got = torch.func.grad(lambda t: ops.linear(t, w).sum())(torch.randn(2, 8))
    assert signatures and got.shape == (2, 8)  # under torch.func the Function's own apply (custom_function_call)
    leaf = x.clone().requires_grad_()
    assert type(ops.linear(leaf, w).grad_fn) is type(D.op("linear").function.apply(leaf, w, None).grad_fn)


# -- one selection path: every public op, forward and backward, reports to the recorder -------------------------
def _recorded(rec, module="logp"):
    return rec.to_dict()["modules"][module]["ops"]


def test_logp_backwards_partials_and_merge_report_like_forward_ops():
    plan = RoutePlan("R/R", "R/R", "R/R")
    rec = ReadbackRecorder("local", "train", plan)
    g = torch.Generator().manual_seed(0)
    t, h, v = 5, 16, 64
    hidden = torch.randn(t, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    logits = torch.randn(t, v, generator=g, requires_grad=True)
    target = torch.randint(0, v, (t,), generator=g)
    with rec.scope("logp"):
        ops.linear_logprobs(hidden, weight, target, 1.0)[0].sum().backward()
        ops.token_logprobs(logits, target, 0.7)[0].sum().backward()
        with torch.no_grad():
            m, s, zt = ops.logp_partials(logits, target, 0.7, 0, v)
            ops.merge_logp_partials(m, s, zt, v)
            ops.linear_logp_partials(hidden, weight, target, 1.0, 0, v)
    seen = _recorded(rec)
    for op in ("linear_logprobs", "linear_logprobs_backward", "token_logprobs", "token_logprobs_backward",
               "logp_partials", "merge_logp_partials", "linear_logp_partials"):
        assert seen[op]["backend_id"] == "rlk.reference" and seen[op]["contract_id"] == "rlk.logp.v1", op
        assert seen[op]["call_count"] >= 1 and seen[op]["fallback"] is False, op


def test_a_registered_preferred_backend_that_is_unavailable_is_a_fallback_strict_refuses(clean_registry):
    """What a CUDA machine without Triton looks like: rlk.triton registered, its probe says no."""
    from rlk_core.backends import Backend
    from rlk_core.errors import RlkPolicyError

    reference = clean_registry.get("swiglu", "rlk.reference").fn
    clean_registry.register(Backend("rlk.fast", "swiglu", reference, devices=("cpu",), priority=20, builtin=True,
                                    available=lambda: (False, "triton is not importable")))
    plan = RoutePlan("R/R", "R/R", "R/R")
    strict = ReadbackRecorder("local", "rollout", plan, mode="strict")
    with strict.scope("ffn"), pytest.raises(RlkPolicyError, match="rlk.fast unavailable: triton is not importable"):
        ops.swiglu(torch.randn(2, 8))
    audit = ReadbackRecorder("local", "rollout", plan, mode="audit")
    with audit.scope("ffn"):
        ops.swiglu(torch.randn(2, 8))
    rec = _recorded(audit, "ffn")["swiglu"]
    assert rec["backend_id"] == "rlk.reference" and rec["fallback"] is True
    assert "rlk.fast unavailable" in rec["fallback_reason"]


def test_selection_reads_the_environment_and_orders_backends_once_per_process(clean_registry, monkeypatch):
    from rlk_core import backends as B

    reads = []
    real_get = B.envs.get
    monkeypatch.setattr(B.envs, "get", lambda name, env=None: reads.append(name) or real_get(name, env))
    sorts = []
    real_backends = clean_registry.backends
    monkeypatch.setattr(clean_registry, "backends", lambda op: sorts.append(op) or real_backends(op))
    clean_registry.refresh()
    x = torch.randn(2, 8)
    for _ in range(5):
        ops.swiglu(x)
        ops.rms_norm(x, torch.ones(8))
    assert reads.count("RLK_BACKENDS") == 1
    assert sorts.count("swiglu") == 1 and sorts.count("rms_norm") == 1


def test_forcing_a_backend_also_forces_its_companions(clean_registry, monkeypatch):
    from rlk_core.backends import Backend

    for op in ("token_logprobs", "token_logprobs_backward"):
        ref = clean_registry.get(op, "rlk.reference").fn
        clean_registry.register(Backend("acme.twin", op, ref, devices=("cpu",), priority=-5, builtin=True))
    monkeypatch.setenv("RLK_BACKENDS", "token_logprobs=acme.twin")
    clean_registry.refresh()
    assert clean_registry.select("token_logprobs_backward", "cpu", (), strict=True).backend.id == "acme.twin"
    assert clean_registry.select("linear", "cpu", (), strict=True).backend.id == "rlk.reference"


def test_select_asks_the_first_candidate_again_on_every_call(clean_registry):
    """The fast path of ``select`` (the first candidate took the last call) still asks it per call: where it
    declines, the next one runs with the declined reason; where it takes the call again, the same selection."""
    from rlk_core.backends import Backend

    reference = clean_registry.get("swiglu", "rlk.reference").fn
    takes = {"now": True}
    clean_registry.register(Backend("rlk.picky", "swiglu", reference, devices=("cpu",), priority=50, builtin=True,
                                    supports=lambda x: (takes["now"], "" if takes["now"] else "not today")))
    clean_registry.refresh()
    first = clean_registry.select("swiglu", "cpu", (torch.randn(2, 8),), strict=True)
    assert first.backend.id == "rlk.picky" and first.fallback_reason is None
    assert clean_registry.select("swiglu", "cpu", (torch.randn(2, 8),), strict=True) is first
    takes["now"] = False
    sel = clean_registry.select("swiglu", "cpu", (torch.randn(2, 8),), strict=True)
    assert sel.backend.id == "rlk.reference" and sel.fallback_reason == "rlk.picky: not today"
    takes["now"] = True
    assert clean_registry.select("swiglu", "cpu", (torch.randn(2, 8),), strict=True).backend.id == "rlk.picky"


def test_select_requalifies_after_the_qualification_cache_is_cleared(clean_registry, monkeypatch):
    """A third-party backend's qualification is cached; the fast path holds only while it is."""
    import rlk_core.testing.qualify as qualify
    from rlk_core.backends import Backend
    from rlk_core.errors import RlkBackendError

    verdict = {"ok": True}
    monkeypatch.setattr(qualify, "qualify_backend", lambda backend, device_type: (verdict["ok"], "judged"))

    reference = clean_registry.get("swiglu", "rlk.reference").fn
    clean_registry.register(Backend("acme.fast", "swiglu", reference, devices=("cpu",), priority=50, origin="acme"))
    clean_registry.refresh()
    x = torch.randn(2, 8)
    assert clean_registry.select("swiglu", "cpu", (x,), strict=True).backend.id == "acme.fast"
    assert clean_registry.select("swiglu", "cpu", (x,), strict=True).backend.id == "acme.fast"
    verdict["ok"] = False
    assert clean_registry.select("swiglu", "cpu", (x,), strict=True).backend.id == "acme.fast"  # cached verdict
    clean_registry._qualified.clear()
    with pytest.raises(RlkBackendError, match="failed its invariance checks on cpu: judged"):
        clean_registry.select("swiglu", "cpu", (x,), strict=True)
    asked = []
    sel = clean_registry.select("swiglu", "cpu", (x,), strict=lambda: asked.append(1) or False)
    assert sel.backend.id == "rlk.reference" and "acme.fast: not qualified (judged)" in sel.fallback_reason
    assert asked == [1]  # strict mode is read only where a backend fails its qualification


def test_strict_mode_follows_the_environment_between_calls(monkeypatch):
    """``strict_now`` (no scope) reads RL_KERNEL_MODE on every call, parsing it only when it changed."""
    from rlk_core import readback

    monkeypatch.delenv("RL_KERNEL_MODE", raising=False)
    assert readback.strict_now()
    monkeypatch.setenv("RL_KERNEL_MODE", "audit")
    assert not readback.strict_now()
    monkeypatch.setenv("RL_KERNEL_MODE", "strict")
    assert readback.strict_now()
    with ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="audit").scope("ffn"):
        assert not readback.strict_now()
