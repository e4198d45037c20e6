"""linear_tp_partials (rlk.gemm.tp.v1): TP 1/2/4/8 shards + the leaf tree == TP 1 bitwise (sequence parallelism on
and off, a whole emulated MLP block), with negative controls; reference arithmetic, batch invariance, backward,
opcheck, errors (docs/ops/linear_tp.md)."""

import pytest
import torch

import rlk_core.ops as ops
from rlk_collectives import reduce_reference, tree_sum_fp32
from rlk_core.errors import RlkInputError
from rlk_core.ops._fixed import tree_sum
from rlk_core.ops.linear_tp import DEFAULT_LEAVES, pairs_sum
from rlk_core.testing import assert_bitwise_equal, assert_close_to_formula, check_batch_invariance

G = DEFAULT_LEAVES
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


def _shard(t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    c = t.shape[-1] // tp
    return t[..., r * c:(r + 1) * c]


def row_parallel(x, w, b, tp, leaves=G, sp=False):
    """A row-parallel linear at TP ``tp``, emulated in one process: rank r's K slices through linear_tp_partials with
    leaves G/tp, the partials merged by rlk.collective.v1's rank tree (``tree_sum_fp32``, what
    ``all_reduce_partials`` runs), rounded once. ``sp``: the merge reduce-scattered over the tokens (sequence
    parallelism), each rank's rows rounded, then all-gathered (``cat``: exact)."""
    parts = [ops.linear_tp_partials(_shard(x, tp, r), _shard(w, tp, r), leaves // tp) for r in range(tp)]
    if not sp:
        return ops.linear_tp_finish(tree_sum_fp32(parts), b, x.dtype)
    rows = x.shape[0] // tp
    mine = [tree_sum_fp32([p[r * rows:(r + 1) * rows] for p in parts]) for r in range(tp)]
    return torch.cat([ops.linear_tp_finish(s, b, x.dtype) for s in mine])


def naive_row_parallel(x, w, b, tp):
    """What a row-parallel linear does without invariant mode: each rank's own rlk.gemm.bi.v1 GEMM rounded to the
    dtype, the ranks' results all-reduced by rlk.collective.v1 (deterministic, but a tree that changes with TP)."""
    parts = [ops.linear(_shard(x, tp, r), _shard(w, tp, r)) for r in range(tp)]
    y = reduce_reference(parts)
    return y if b is None else (y.float() + b.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 8), (19, 37, 8 * 13), (64, 48, 1024), (5, 123, 8 * 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_tp_1_2_4_8_give_the_bits_of_tp_1(shape, dtype, bias):
    x, w, b = _inputs(*shape, dtype)
    b = b if bias else None
    want = ops.linear_tp(x, w, b)
    for tp in (1, 2, 4, 8):
        assert_bitwise_equal(row_parallel(x, w, b, tp), want, f"TP {tp}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sequence_parallel_on_and_off_give_the_same_bits(dtype):
    x, w, b = _inputs(64, 40, 512, dtype, seed=3)
    want = ops.linear_tp(x, w, b)
    for tp in (1, 2, 4, 8):
        assert_bitwise_equal(row_parallel(x, w, b, tp, sp=True), want, f"TP {tp} SP")


def test_negative_control_the_per_rank_gemm_and_rank_sum_differ_across_tp():
    """Without invariant mode the row-parallel result changes with TP (bf16 and fp32 partials alike), and even at
    TP 1 rlk.gemm.bi.v1's K tree is not rlk.gemm.tp.v1's."""
    x, w, b = _inputs(32, 64, 1024, torch.bfloat16, seed=1)
    ref1 = naive_row_parallel(x, w, b, 1)
    for tp in (2, 4, 8):
        assert not torch.equal(naive_row_parallel(x, w, b, tp), ref1), tp
    fp32 = [sum(ops.linear(_shard(x.float(), tp, r), _shard(w.float(), tp, r)) for r in range(tp)) for tp in (1, 2, 4)]
    assert not torch.equal(fp32[0], fp32[1]) and not torch.equal(fp32[0], fp32[2])
    assert not torch.equal(ops.linear_tp(x, w, b), ref1)


def test_negative_control_tree_sum_s_pairing_over_the_leaves_is_not_tp_invariant():
    """The in-op tree must be adjacent pairs: ``tree_sum``'s upper-half-onto-lower over 8 leaves adds leaf 0 to leaf
    4 first (on different ranks at TP 2) and gives other bits."""
    x, w, _ = _inputs(32, 64, 1024, torch.float32, seed=2)
    leaves = [ops.linear_tp_partials(_shard(x, G, j), _shard(w, G, j), 1) for j in range(G)]
    assert torch.equal(pairs_sum(leaves), ops.linear_tp_partials(x, w, G))
    assert not torch.equal(tree_sum(torch.stack(leaves, -1)), pairs_sum(leaves))


def test_the_leaf_tree_is_the_collective_s_rank_tree():
    x, w, _ = _inputs(16, 24, 256, torch.bfloat16, seed=4)
    for n in (1, 2, 4, 8):
        parts = [ops.linear_tp_partials(_shard(x, n, j), _shard(w, n, j), 1) for j in range(n)]
        assert torch.equal(pairs_sum(parts), tree_sum_fp32(parts))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_leaf_is_the_batch_invariant_gemm(dtype):
    """G = 1: one leaf over K is rlk.gemm.bi.v1 exactly (its tree, its bias add, its one rounding)."""
    x, w, b = _inputs(19, 33, 300, dtype, seed=5)
    assert torch.equal(ops.linear_tp(x, w, b, leaves=1), ops.linear(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 8), (5, 123, 8 * 16), (2, 33, 1024)])
def test_matches_float64_formula(shape, dtype):
    x, w, b = _inputs(*shape, dtype)
    want = x.double() @ w.double().T + b.double()
    assert_close_to_formula(ops.linear_tp(x, w, b), want)
    s = ops.linear_tp_partials(x, w, G)
    assert s.dtype == torch.float32 and s.shape == (shape[0], shape[1])


def test_batch_invariant_and_leading_dims():
    x, w, b = _inputs(48, 40, 512, torch.bfloat16, seed=6)
    ok, detail = check_batch_invariance(lambda r: ops.linear_tp(r, w, b), x, batch_sizes=range(1, 49), probe=5)
    assert ok, detail
    x3 = x.view(4, 12, 512)
    assert torch.equal(ops.linear_tp(x3, w, b), ops.linear_tp(x, w, b).view(4, 12, 40))
    assert torch.equal(ops.linear_tp(x[:, ::2].contiguous(), w[:, ::2].contiguous()),
                       ops.linear_tp(x[:, ::2], w[:, ::2]))  # strided operands: the same bits


def test_empty_and_zero_k():
    x, w, _ = _inputs(0, 5, 16, torch.bfloat16)
    assert ops.linear_tp_partials(x, w, 8).shape == (0, 5)
    z = ops.linear_tp_partials(torch.empty(3, 0), torch.empty(4, 0), 1)
    assert torch.equal(z, torch.zeros(3, 4))


def test_finish_rounds_once_and_makes_nan_canonical():
    s = torch.tensor([[1.0 + 2**-9, float("nan"), float("inf"), -0.0]])
    s[0, 1] = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    y = ops.linear_tp_finish(s, None, torch.bfloat16)
    assert y.view(torch.int16)[0, 1].item() == 0x7FC0
    assert y[0, 0].item() == 1.0 and y[0, 2].item() == float("inf") and str(y[0, 3].item()) == "-0.0"
    with_bias = ops.linear_tp_finish(torch.full((2, 3), 0.5), torch.ones(3, dtype=torch.bfloat16), torch.bfloat16)
    assert torch.equal(with_bias, torch.full((2, 3), 1.5, dtype=torch.bfloat16))


def test_emulated_mlp_block_at_tp_1_2_4_8_with_sp_is_bitwise_tp_1():
    """A Qwen3-style MLP block emulated at TP t: RMSNorm on the replicated rows, column-parallel gate/up (each rank
    its column shards of the same rlk.gemm.bi.v1 GEMM), swiglu, row-parallel down through rlk.gemm.tp.v1 and the
    rank tree, residual — TP 1, 2, 4 and 8, SP on and off, all the same bits; the native row-parallel sum differs."""
    g = torch.Generator().manual_seed(7)
    t, d, f = 16, 64, 256
    dt = torch.bfloat16
    h = torch.randn(t, d, generator=g).to(dt)
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).to(dt)
    gate = (torch.randn(f, d, generator=g) / d**0.5).to(dt)
    up = (torch.randn(f, d, generator=g) / d**0.5).to(dt)
    down = (torch.randn(d, f, generator=g) / f**0.5).to(dt)

    def block(tp, sp, invariant=True):
        x = ops.rms_norm(h, norm_w, 1e-6)
        rows = lambda w, r: w[r * (f // tp):(r + 1) * (f // tp)]  # noqa: E731  (the rank's output rows)
        act = [ops.swiglu(torch.cat([ops.linear(x, rows(gate, r)), ops.linear(x, rows(up, r))], -1)) for r in range(tp)]
        a = torch.cat(act, -1)  # rank r's activations are the columns r of the TP 1 activation
        y = row_parallel(a, down, None, tp, sp=sp) if invariant else naive_row_parallel(a, down, None, tp)
        return (y.float() + h.float()).to(dt)

    want = block(1, False)
    for tp in (1, 2, 4, 8):
        for sp in (False, True):
            assert_bitwise_equal(block(tp, sp), want, f"TP {tp} SP {sp}")
    assert any(not torch.equal(block(tp, False, invariant=False), block(1, False, invariant=False)) for tp in (2, 4, 8))


# -- backward -------------------------------------------------------------------------------------------------------
def test_backward_is_linear_s_and_tp_shards_give_the_slices():
    x, w, _ = _inputs(24, 40, 256, torch.bfloat16, seed=8)
    dy = torch.randn(24, 40, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)

    def grads(fn, xx, ww):
        xx, ww = xx.detach().requires_grad_(), ww.detach().requires_grad_()
        torch.autograd.backward(fn(xx, ww), dy)
        return xx.grad, ww.grad

    dx, dw = grads(lambda a, b: ops.linear_tp(a, b), x, w)
    dx_bi, dw_bi = grads(lambda a, b: ops.linear(a, b), x, w)
    assert torch.equal(dx, dx_bi) and torch.equal(dw, dw_bi)
    for tp in (2, 4, 8):
        for r in range(tp):
            def rank(a, b, n=G // tp):
                return ops.linear_tp_finish(ops.linear_tp_partials(a, b, n), None, a.dtype)
            dxr, dwr = grads(rank, _shard(x, tp, r), _shard(w, tp, r))
            assert torch.equal(dxr, _shard(dx, tp, r)) and torch.equal(dwr, _shard(dw, tp, r)), (tp, r)
    again = grads(lambda a, b: ops.linear_tp(a, b), x, w)
    assert torch.equal(again[0], dx) and torch.equal(again[1], dw)


def test_opcheck():
    x, w, b = _inputs(5, 7, 64, torch.float32)
    torch.library.opcheck(torch.ops.rlk.linear_tp_partials, (x.requires_grad_(), w, 4))
    torch.library.opcheck(torch.ops.rlk.linear_tp, (x, w.requires_grad_(), b.requires_grad_(), 4))
    torch.library.opcheck(torch.ops.rlk.linear_tp, (x, w, None, 8))


# -- linear_tp: the one op of TP 1 (torch.ops.rlk.linear_tp) --------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_tp_is_the_partial_finished(dtype):
    """``linear_tp`` (one op: on rlk.triton one launch sequence with the store finished) is bitwise
    ``linear_tp_finish(linear_tp_partials(...))`` with and without a bias, NaN and inf included; a bias of another
    dtype takes the two steps; the negative control: rounding before the bias add differs."""
    x, w, b = _inputs(19, 37, 8 * 13, dtype, seed=11)
    x[0, 3], x[1, 60], x[2, 5] = float("inf"), float("nan"), float("-inf")
    for bias in (None, b, b.float() if dtype != torch.float32 else b.half()):
        for leaves in (1, 2, 8):
            got = ops.linear_tp(x, w, bias, leaves)
            want = ops.linear_tp_finish(ops.linear_tp_partials(x, w, leaves), bias, dtype)
            assert_bitwise_equal(got, want, f"{dtype} leaves={leaves}")
            assert got[1].isnan().all()
    assert_bitwise_equal(torch.ops.rlk.linear_tp(x, w, b, 8), ops.linear_tp(x, w, b), "torch.ops")
    if dtype != torch.float32:
        s = ops.linear_tp_partials(x, w, 8)
        early = ops.linear_tp_finish(ops.linear_tp_finish(s, None, dtype).float(), b, dtype)
        assert not torch.equal(early, ops.linear_tp(x, w, b)), "negative control: rounded before the bias add"


def test_linear_tp_backward_is_the_two_steps():
    """dx, dW and the bias gradient of the one op are the two steps' (partials' backward on dy, the bias's through
    the fp32 add), bit for bit, on finite outputs."""
    x, w, b = _inputs(24, 40, 256, torch.bfloat16, seed=12)
    dy = torch.randn(24, 40, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)

    def grads(fn):
        xx, ww, bb = (t.detach().requires_grad_() for t in (x, w, b))
        torch.autograd.backward(fn(xx, ww, bb), dy)
        return xx.grad, ww.grad, bb.grad

    one = grads(lambda a, c, d: ops.linear_tp(a, c, d))
    two = grads(lambda a, c, d: ops.linear_tp_finish(ops.linear_tp_partials(a, c, G), d, a.dtype))
    for g1, g2, name in zip(one, two, ("dx", "dw", "db"), strict=True):
        assert_bitwise_equal(g1, g2, name)


def test_linear_tp_refuses_bad_bias():
    x, w, b = _inputs(2, 3, 40, torch.bfloat16)
    with pytest.raises(RlkInputError, match="bias must have shape"):
        torch.ops.rlk.linear_tp(x, w, b[:2], 8)
    with pytest.raises(RlkInputError):
        torch.ops.rlk.linear_tp(x, w, b.float(), 8)  # the op takes x's dtype (linear_tp() converts in two steps)
    with pytest.raises(RlkInputError, match="not divisible by leaves=8"):
        ops.linear_tp(x[:, :36], w[:, :36], b, 8)


# -- errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("leaves, match", [(3, "power of two"), (16, "power of two from 1 to 8"), (0, "power of two"),
                                           (True, "power of two")])
def test_bad_leaf_counts_are_refused(leaves, match):
    x, w, _ = _inputs(2, 3, 48, torch.bfloat16)
    with pytest.raises(RlkInputError, match=match):
        ops.linear_tp_partials(x, w, leaves)


def test_bad_inputs_are_refused():
    x, w, b = _inputs(2, 3, 40, torch.bfloat16)
    with pytest.raises(RlkInputError, match="not divisible by leaves=8"):
        ops.linear_tp_partials(x[:, :36], w[:, :36], 8)
    with pytest.raises(RlkInputError, match="K=40"):
        ops.linear_tp_partials(x, w[:, :32], 8)
    with pytest.raises(RlkInputError):
        ops.linear_tp_partials(x, w.float(), 8)
    with pytest.raises(RlkInputError, match="float32 merged partial"):
        ops.linear_tp_finish(x, None, torch.bfloat16)
    with pytest.raises(RlkInputError, match="bias must have shape"):
        ops.linear_tp_finish(x.float(), b[:2], torch.bfloat16)
