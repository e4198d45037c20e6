"""How the rlk ops are registered with the PyTorch dispatcher (:func:`rlk_core.ops._dispatch.define`:
``torch.library.Library`` directly, not ``torch.library.custom_op``) and what that registration keeps: the
schemas ``custom_op`` inferred, the mutation annotations and version counters, autograd in and out of
inference mode, fake and meta tensors, ``torch.compile(fullgraph=True)`` tracing the ops opaquely."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rlk_core import ops
from rlk_core.backends import Backend
from rlk_core.ops import _dispatch as D
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.testing import assert_bitwise_equal

from ._modes import Spy as _Spy

# The schema of every rlk op as torch.library.custom_op inferred it (recorded at cf9ba2e, torch 2.13), tags
# pt2_compliant_tag; ops added since are checked against what custom_op would infer (the next test).
SCHEMAS = {
    "attention_decode": "rlk::attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
                        "Tensor seq_lens, float scale) -> Tensor",
    "attention_paged_prefill": "rlk::attention_paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, "
                               "Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens, float scale) -> Tensor",
    "attention_varlen": "rlk::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
                        "Tensor cu_seqlens_k, float scale, bool causal, Tensor? q_positions) -> Tensor",
    "attention_varlen_backward": "rlk::attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
                                 "Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, bool causal, "
                                 "Tensor? q_positions) -> (Tensor, Tensor, Tensor)",
    "kv_cache_write": "rlk::kv_cache_write(Tensor k, Tensor v, Tensor(a2!) k_cache, Tensor(a3!) v_cache, "
                      "Tensor slot_mapping) -> ()",
    "linear": "rlk::linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "linear_logp_partials": "rlk::linear_logp_partials(Tensor hidden, Tensor weight, Tensor target, "
                            "Tensor temperature, SymInt vocab_start, SymInt vocab_size) -> (Tensor, Tensor, Tensor)",
    "linear_logprobs": "rlk::linear_logprobs(Tensor hidden, Tensor[] weight, Tensor target, Tensor temperature) "
                       "-> (Tensor, Tensor)",
    "linear_logprobs_backward": "rlk::linear_logprobs_backward(Tensor hidden, Tensor[] weight, Tensor target, "
                                "Tensor temperature, Tensor lse, Tensor grad_logp, Tensor grad_lse) "
                                "-> (Tensor, Tensor[])",
    "logp_partials": "rlk::logp_partials(Tensor logits_shard, Tensor target, Tensor temperature, "
                     "SymInt vocab_start, SymInt vocab_size) -> (Tensor, Tensor, Tensor)",
    "merge_logp_partials": "rlk::merge_logp_partials(Tensor m, Tensor s, Tensor z_target, SymInt vocab_size) "
                           "-> (Tensor, Tensor)",
    "rms_norm": "rlk::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "rope": "rlk::rope(Tensor x, Tensor positions, float theta, SymInt rotary_dim) -> Tensor",
    "swiglu": "rlk::swiglu(Tensor x) -> Tensor",
    "token_logprobs": "rlk::token_logprobs(Tensor[] logits, Tensor target, Tensor temperature) -> (Tensor, Tensor)",
    "token_logprobs_backward": "rlk::token_logprobs_backward(Tensor[] logits, Tensor target, Tensor temperature, "
                               "Tensor lse, Tensor grad_logp, Tensor grad_lse) -> Tensor[]",
}


def _rlk_ops() -> set[str]:
    return {n for n in dir(torch.ops.rlk) if isinstance(getattr(torch.ops.rlk, n), torch._ops.OpOverloadPacket)}


def test_every_op_keeps_the_schema_custom_op_inferred():
    assert set(SCHEMAS) <= _rlk_ops()
    for name, schema in SCHEMAS.items():
        op = getattr(torch.ops.rlk, name).default
        assert str(op._schema) == schema, name
        assert torch.Tag.pt2_compliant_tag in op.tags, name


def test_every_dispatch_op_has_the_schema_custom_op_would_infer():
    """For each op :func:`~rlk_core.ops._dispatch.define` registered (those recorded above and any added since):
    ``torch.library.infer_schema`` of its check function with its ``mutates_args`` — what custom_op would define."""
    for name, rlk_op in D._OPS.items():
        op = getattr(torch.ops.rlk, name).default
        inferred = torch.library.infer_schema(rlk_op.check, mutates_args=rlk_op.mutates_args)
        assert str(op._schema) == f"rlk::{name}{inferred}", name
        assert torch.Tag.pt2_compliant_tag in op.tags, name


def test_dispatch_ops_are_library_ops_with_cpu_cuda_meta_and_autograd_kernels():
    assert {"linear", "rms_norm", "swiglu", "rope", "attention_decode", "kv_cache_write"} <= set(D._OPS)
    for name in D._OPS:
        qualname = f"rlk::{name}"
        assert torch._library.custom_ops._maybe_get_opdef(qualname) is None, name  # not a CustomOpDef
        for key in ("CPU", "CUDA", "Meta", "Autograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (name, key)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "ADInplaceOrView") == (
            name == "kv_cache_write"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd"), name


# -- mutation ----------------------------------------------------------------------------------------------------
def _cache_args():
    k = torch.randn(3, 2, 8)
    return k, k + 1, torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8), torch.tensor([0, 5, -1])



def test_kv_cache_write_schema_marks_the_caches_written_and_bumps_their_versions(clean_registry):
    schema = torch.ops.rlk.kv_cache_write.default._schema
    assert schema.is_mutable
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["k_cache", "v_cache"]
    # a backend that writes nothing: the version counters move only by the op's registration
    clean_registry.register(Backend("acme.null", "kv_cache_write", lambda *a: None, devices=("cpu",), priority=99,
                                    builtin=True))
    clean_registry.refresh()
    k, v, kc, vc, slots = _cache_args()
    for ctx in (torch.enable_grad, torch.no_grad, _Spy):  # the Autograd kernel runs the op, or re-enters below
        before = (kc._version, vc._version, k._version)
        with ctx():
            torch.ops.rlk.kv_cache_write.default(k, v, kc, vc, slots)
        assert (kc._version, vc._version, k._version) == (before[0] + 1, before[1] + 1, before[2]), ctx
    with torch.inference_mode():  # inference tensors have no version counter; nothing to bump
        k, v, kc, vc, slots = _cache_args()
        torch.ops.rlk.kv_cache_write.default(k, v, kc, vc, slots)


def test_kv_cache_write_through_the_dispatcher_writes_what_the_direct_path_writes():
    k, v, kc, vc, slots = _cache_args()
    kc2, vc2 = kc.clone(), vc.clone()
    ops.kv_cache_write(k, v, kc, vc, slots)
    torch.ops.rlk.kv_cache_write.default(k, v, kc2, vc2, slots)
    assert_bitwise_equal(kc, kc2)
    assert_bitwise_equal(vc, vc2)
    assert kc.count_nonzero() > 0


def test_no_autograd_formula_for_a_mutating_op():
    from rlk_core.ops import attention

    with pytest.raises(RuntimeError, match="mutates its arguments"):
        attention._kv_cache_write.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, i, o: None)


# -- autograd ----------------------------------------------------------------------------------------------------
def test_dispatcher_autograd_in_and_out_of_inference_mode():
    """``torch.ops.rlk.linear`` with grad on and an input that requires grad records the op's backward (the same
    gradients as the eager path); under no_grad, with no input that requires grad, or in inference mode it runs
    the op with no graph — the same bits every time."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g) for s in ((5, 16), (12, 16), (12,)))
    want = ops.linear(x, w, b)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out = torch.ops.rlk.linear.default(*leaves)
    assert out.grad_fn is not None and "GeneratedBackwardFor_rlk_linear" in type(out.grad_fn).__name__
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, leaves, grad)
    eager = [t.clone().requires_grad_() for t in (x, w, b)]
    for a, e in zip(got, torch.autograd.grad(ops.linear(*eager), eager, grad), strict=True):
        assert_bitwise_equal(a, e)
    assert_bitwise_equal(out.detach(), want)
    with torch.no_grad():
        plain = torch.ops.rlk.linear.default(*leaves)
    assert plain.grad_fn is None and not plain.requires_grad
    unrequired = torch.ops.rlk.linear.default(x, w, b)
    assert unrequired.grad_fn is None and not unrequired.requires_grad
    with torch.inference_mode():
        inferred = torch.ops.rlk.linear.default(*leaves)
    assert inferred.is_inference() and inferred.grad_fn is None
    for t in (plain, unrequired, inferred):
        assert_bitwise_equal(t, want)


def test_a_list_input_that_requires_grad_gets_its_gradient_through_the_dispatcher():
    """``token_logprobs`` takes its logits as a list (the dispatcher path's autograd handles tensor lists)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=g, requires_grad=True)
    target = torch.randint(0, 64, (4,), generator=g)
    logp, _ = ops.token_logprobs([logits[:, :32], logits[:, 32:]], target, 0.5)
    (dlogits,) = torch.autograd.grad(logp.sum(), logits)
    leaf = logits.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(ops.token_logprobs(leaf, target, 0.5)[0].sum(), leaf)
    assert_bitwise_equal(dlogits, want)


def test_an_op_without_a_backward_runs_forward_and_refuses_backward():
    """As ``torch.library.custom_op`` did: the forward runs on inputs that require grad, the backward raises."""
    q = torch.randn(2, 4, 16, requires_grad=True)
    cache = torch.randn(3, 16, 2, 16)
    table, lens = torch.tensor([[0], [2]], dtype=torch.int32), torch.tensor([3, 16], dtype=torch.int32)
    out = torch.ops.rlk.attention_decode.default(q, cache, cache, table, lens, 0.25)
    assert out.requires_grad
    assert_bitwise_equal(out.detach(), ops.attention_decode(q.detach(), cache, cache, table, lens, 0.25))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


# -- what runs below autograd ------------------------------------------------------------------------------------
def test_below_is_plain_only_for_a_backend_kernel_and_nothing_else():
    x = torch.randn(3, 4)
    after = torch._C._after_autograd_keyset
    assert (torch._C._dispatch_keys(x) & after).raw_repr() in D._PLAIN_BELOW  # the set built by hand is real
    assert D._below_is_plain(torch._C._dispatch_keys(x))
    with torch.inference_mode():
        assert D._below_is_plain(torch._C._dispatch_keys(torch.randn(2)))
    for other in (x.to("meta"), torch.randn(2, dtype=torch.cfloat).conj(), torch._to_functional_tensor(x)):
        assert not D._below_is_plain(torch._C._dispatch_keys(other)), torch._C._dispatch_keys(other)


def test_the_key_sets_the_autograd_kernel_sees_for_plain_tensors_are_plain(monkeypatch):
    """What the dispatcher hands the Autograd kernel (fallthrough keys dropped: no ADInplaceOrView for a
    functional op, ADInplaceOrView for kv_cache_write) is taken as plain: the kernel runs the op at once."""
    monkeypatch.setattr(D, "_BELOW_IS_PLAIN", {})
    torch.ops.rlk.swiglu.default(torch.randn(2, 8))
    torch.ops.rlk.kv_cache_write.default(*_cache_args())
    assert len(D._BELOW_IS_PLAIN) == 2 and all(D._BELOW_IS_PLAIN.values()), D._BELOW_IS_PLAIN


def test_a_dispatch_mode_below_autograd_still_sees_the_op_called_through_torch_ops():
    """With a mode active the Autograd kernel re-enters the dispatcher below autograd (the mode sees the op, then
    runs it); the result and the readback are those of a plain call."""
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="strict")
    spy = _Spy()
    with rec.scope("ffn"):
        with spy:
            got = torch.ops.rlk.linear.default(x, w, None)
        want = torch.ops.rlk.linear.default(x, w, None)
    assert spy.ops == ["rlk.linear.default"]
    assert_bitwise_equal(got, want)
    linear = rec.to_dict()["modules"]["ffn"]["ops"]["linear"]
    assert linear["call_count"] == 2 and linear["backend_id"] == "rlk.reference" and not linear["fallback"]


def test_fake_and_meta_tensors_get_the_fake_implementation_and_select_no_backend():
    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="strict")
    with rec.scope("ffn"):
        y = torch.ops.rlk.linear.default(torch.empty(5, 16, device="meta"), torch.empty(8, 16, device="meta"), None)
        with FakeTensorMode() as mode:
            s = torch.ops.rlk.swiglu.default(mode.from_tensor(torch.randn(3, 2, 10)))
            kc = mode.from_tensor(torch.zeros(2, 4, 1, 8))
            k, slots = mode.from_tensor(torch.randn(2, 1, 8)), mode.from_tensor(torch.tensor([0, 3]))
            torch.ops.rlk.kv_cache_write.default(k, k, kc, kc.clone(), slots)
    assert y.device.type == "meta" and y.shape == (5, 8)
    assert s.shape == (3, 2, 5) and "Fake" in type(s).__name__
    assert "ffn" not in rec.to_dict()["modules"]  # no backend ran


def test_torch_compile_fullgraph_traces_the_ops_opaquely():
    """AOTAutograd (functionalization, fake tensors, the joint graph) over the public ops: the forward graph holds
    each rlk op as one node (kv_cache_write functionalized), none of its reference arithmetic; outputs, gradients
    and the written cache equal eager bit for bit."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def block(x, w, nw, kc, vc, slots, pos):
        y = ops.swiglu(ops.linear(ops.rms_norm(x, nw, 1e-6), w))
        q = ops.rope(y.view(y.shape[0], 2, 8), pos, 1e4, 8)
        ops.kv_cache_write(q, q, kc, vc, slots)
        return q

    g = torch.Generator().manual_seed(2)
    x, w, nw = torch.randn(4, 16, generator=g), torch.randn(32, 16, generator=g), torch.randn(16, generator=g)
    slots, pos = torch.tensor([0, 1, 2, 5]), torch.arange(4)
    runs = []
    for fn in (torch.compile(block, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True),
               block):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        kc, vc = torch.zeros(3, 2, 2, 8), torch.zeros(3, 2, 2, 8)
        out = fn(leaves[0], leaves[1], nw, kc, vc, slots, pos)
        runs.append((out.detach(), *torch.autograd.grad(out.sum(), leaves), kc))
    torch._dynamo.reset()
    for got, want in zip(*runs, strict=True):
        assert_bitwise_equal(got, want)
    forward = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [t for t in forward if t.startswith("rlk.")] == [
        "rlk.rms_norm.default", "rlk.linear.default", "rlk.swiglu.default", "rlk.rope.default"]
    assert "auto_functionalized_v2" in forward or "auto_functionalized" in forward
    assert not any(t.startswith("aten.") and t != "aten.view.default" for t in forward), forward
