"""``linear_tp_partials`` on the GPU (rlk.gemm.tp.v1, backend ``rlk.triton``), emulated TP on one device: each rank's
K slice run with that rank's own launch (its shapes, G / TP leaves), the partials merged by rlk.collective.v1's rank
tree in process (``tree_sum_fp32``) and rounded once — TP 1, 2, 4, 8 bitwise equal on the Qwen3-8B row-parallel
shapes at decode and training M; batch-invariant; close to the reference; the native per-rank GEMM + sum differs.
Every variant of the kernel (fused, split, stash: ``rlk_core.ops.linear_tp.triton``), forced through the launch plan,
gives the rule's bits at every TP, and a row's bits do not depend on M across the rule's variant switch.
(The rule's tests passed in the clean run of `tests/gpu` at `c9d2ad4`, before the variants; the variant tests are
written, not run.) The forced-only ``smem`` variant (the Gluon kernel, sm_90): its partial bitwise fused's and the
op's at 1 / 2 / 4 / 8 leaves, with a negative control (the leaves summed in sequence differ) — written, not run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlk_collectives import reduce_reference, tree_sum_fp32
from rlk_core.ops import linear_tp, linear_tp_finish, linear_tp_partials
from rlk_core.ops._plan import jit_plan
from rlk_core.ops.linear_tp import triton as T
from rlk_core.ops.linear_tp.reference import linear_tp_partials_reference
from rlk_core.testing import check_batch_invariance

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (4096, 12288)]  # o_proj, down_proj of Qwen3-8B: (N, K)
M_LIST = [1, 7, 16, 17, 128, 1000, 4096]


def _inputs(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).bfloat16()
    return x, w


def _emulated(x, w, tp, g=8, which=None):
    c = x.shape[1] // tp

    def part(xr, wr):
        if which is None:
            return linear_tp_partials(xr, wr, g // tp)
        return T.partials(jit_plan(x.device), xr, wr, g // tp, which)

    parts = [part(x[:, r * c:(r + 1) * c], w[:, r * c:(r + 1) * c]) for r in range(tp)]
    return linear_tp_finish(tree_sum_fp32(parts), None, x.dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", M_LIST)
def test_emulated_tp_1_2_4_8_bitwise(m, n, k):
    x, w = _inputs(m, n, k)
    want = linear_tp(x, w)
    for tp in (1, 2, 4, 8):
        assert torch.equal(_emulated(x, w, tp), want), (m, n, k, tp)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 17, T.SPLIT_MAX_M, T.SPLIT_MAX_M + 1, 1000])
def test_every_variant_at_every_tp_gives_the_rules_bits(m, n, k):
    x, w = _inputs(m, n, k, seed=3)
    want = linear_tp(x, w)
    for which in T.VARIANTS:
        for tp in (1, 2, 4, 8):
            assert torch.equal(_emulated(x, w, tp, which=which), want), (m, n, k, which, tp)


def test_rows_across_the_variant_switch():
    """M = SPLIT_MAX_M runs split, one row more runs stash (the rule), and 1 row decode's split tile: a row's bits
    are the same in all three, at TP 1 and TP 4 (the rank's own leaves)."""
    x, w = _inputs(T.SPLIT_MAX_M + 1, 4096, 12288, seed=4)
    assert T.variant(x.dtype, T.SPLIT_MAX_M, 4096, 12288 // 8) != T.variant(x.dtype, T.SPLIT_MAX_M + 1, 4096, 1536)
    for tp in (1, 4):
        c = 12288 // tp
        xr, wr = x[:, :c].contiguous(), w[:, :c].contiguous()
        big = linear_tp_partials(xr, wr, 8 // tp)
        assert torch.equal(linear_tp_partials(xr[:T.SPLIT_MAX_M], wr, 8 // tp), big[:T.SPLIT_MAX_M]), tp
        assert torch.equal(linear_tp_partials(xr[5:6], wr, 8 // tp), big[5:6]), tp


def test_negative_control_variants_are_not_the_bi_gemm():
    x, w = _inputs(300, 4096, 4096, seed=5)
    for which in T.VARIANTS:
        assert not torch.equal(T.partials(jit_plan(x.device), x, w, 8, which), T.partials(jit_plan(x.device), x, w,
                                                                                          1, which)), which


def test_close_to_the_reference_and_batch_invariant():
    x, w = _inputs(64, 512, 4096, seed=1)
    got = linear_tp_partials(x, w, 8)
    ref = linear_tp_partials_reference(x.cpu(), w.cpu(), 8)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-4)
    ok, detail = check_batch_invariance(lambda r: linear_tp(r, w), x, batch_sizes=range(1, 65), probe=5)
    assert ok, detail


def test_negative_control_per_rank_cublas_and_sum_differs():
    x, w = _inputs(256, 4096, 12288, seed=2)
    c = 12288 // 4
    naive = reduce_reference([F.linear(x[:, r * c:(r + 1) * c], w[:, r * c:(r + 1) * c]) for r in range(4)])
    assert not torch.equal(naive, F.linear(x, w))
    assert not torch.equal(naive, linear_tp(x, w))


# -- linear_tp at TP 1: the finished store (bias, one rounding, canonical NaN in its last kernel; written, not run) --
def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 17, T.SPLIT_MAX_M, T.SPLIT_MAX_M + 1, 1000])
def test_every_variant_finished_is_the_partial_finished(m, dtype):
    """Each variant with its store finished (fused's and stash's epilogue, split's merge) and the op (rlk.cuda where
    built) give linear_tp_finish of the fp32 partial bit for bit, with and without a bias, rows with inf and NaN."""
    x, w = (t.to(dtype) for t in _inputs(m, 4096, 4096, seed=6))
    b = torch.randn(4096, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda").to(dtype)
    x[0, 3], x[0, 4000], x[m - 1, 17] = float("inf"), float("-inf"), float("nan")
    plan = jit_plan(x.device)
    for bias in (None, b):
        want = linear_tp_finish(linear_tp_partials(x, w, 8), bias, dtype)
        assert torch.equal(_bits(linear_tp(x, w, bias, 8)), _bits(want)), (m, dtype, bias is None)
        for which in T.VARIANTS:
            got = T.finished(plan, x, w, bias, 8, which)
            assert torch.equal(_bits(got), _bits(want)), (m, dtype, which, bias is None)
    assert want[m - 1].isnan().all() and (want[0].isnan().any() or want[0].isinf().any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_finished_merge_rounds_as_torch_on_special_values(dtype):
    """The split's merge finished on the GPU, on crafted fp32 leaves (rounding ties, overflow, subnormals, signed zeros,
    infinities, NaNs with payloads) and a bias: bitwise torch's conversion and masked_fill (linear_tp_finish)."""
    import triton

    from rlk_core.ops.linear_tp.reference import pairs_sum

    words = torch.tensor([0x7FC00123, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64).to(torch.int32)
    special = torch.cat([torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 + 2**-11, 3.4e38, -3.4e38,
                                       65520.0, 65519.0, 1e-40, -1e-40, 3e-8, 1e-45, 0.0, -0.0, float("inf"),
                                       float("-inf")]), words.view(torch.float32)]).cuda()
    n = special.numel()
    g = torch.Generator(device="cuda").manual_seed(8)
    ws = torch.randn(8, 64, n, generator=g, device="cuda")
    ws[:, ::2] = 0.0
    ws[0, ::2] = special
    for bias in (None, special.flip(0).to(dtype), torch.randn(n, generator=g, device="cuda").to(dtype)):
        got = torch.empty(64, n, dtype=dtype, device="cuda")
        T._linear_tp_merge_kernel[(triton.cdiv(64 * n, T.MERGE_BLOCK),)](
            ws, got, ws if bias is None else bias, 64 * n, n, LEAVES=8, FINISH=True, HAS_BIAS=bias is not None,
            BLOCK=T.MERGE_BLOCK, num_warps=4)
        want = linear_tp_finish(pairs_sum(list(ws)), bias, dtype)
        assert torch.equal(_bits(got), _bits(want)), (dtype, bias is None)


# -- the smem variant (rlk_core.ops.linear_tp.gluon: Hopper Gluon, forced only; written, not run) -----------------
def _sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the smem variant is sm_90 only (TMA + wgmma)")


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 17, 1024, 4096])
def test_smem_variant_gives_fused_and_the_ops_bits(m, n, k):
    """The Gluon kernel's fp32 partial is bitwise fused's and the op's at 1 / 2 / 4 / 8 leaves (each a rank's
    slice of G = 8 at TP 8 / 4 / 2 / 1: the leaf length of TP 1), and finished at TP 1 bitwise linear_tp."""
    _sm90()
    x, w = _inputs(m, n, k, seed=9)
    plan = jit_plan(x.device)
    for leaves in (1, 2, 4, 8):
        c = k * leaves // 8
        xr, wr = x[:, :c], w[:, :c].contiguous()
        got = T.partials(plan, xr, wr, leaves, "smem")
        assert torch.equal(got, T.partials(plan, xr, wr, leaves, "fused")), (m, n, k, leaves)
        assert torch.equal(got, linear_tp_partials(xr, wr, leaves)), (m, n, k, leaves)
    assert torch.equal(T.finished(plan, x, w, None, 8, "smem"), linear_tp(x, w)), (m, n, k)


def test_negative_control_smem_is_not_the_sequential_sum_of_leaves():
    """The leaves summed left to right ((l0 + l1) + l2) + ... (each leaf the smem kernel's own one-leaf result)
    differ from the smem kernel's tree, so the equalities above can fail."""
    _sm90()
    x, w = _inputs(1024, 4096, 4096, seed=10)
    plan = jit_plan(x.device)
    c = 4096 // 8
    seq = None
    for j in range(8):
        leaf = T.partials(plan, x[:, j * c:(j + 1) * c], w[:, j * c:(j + 1) * c].contiguous(), 1, "smem")
        seq = leaf if seq is None else seq + leaf
    tree = T.partials(plan, x, w, 8, "smem")
    assert not torch.equal(tree, seq)
    assert not torch.equal(tree, T.partials(plan, x, w, 1, "smem"))  # nor one leaf over all of K
    torch.testing.assert_close(tree, seq, rtol=1e-5, atol=1e-4)


def test_smem_refuses_what_it_does_not_implement():
    _sm90()
    x, w = _inputs(64, 256, 8 * 80, seed=11)  # leaf 80: not a multiple of BLOCK_K 64
    with pytest.raises(ValueError, match="EVEN_K only"):
        T.partials(jit_plan(x.device), x, w, 8, "smem")
    with pytest.raises(ValueError, match="bf16 / fp16 only"):
        T.partials(jit_plan(x.device), x.float(), w.float(), 8, "smem")
