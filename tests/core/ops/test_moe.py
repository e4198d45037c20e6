"""The MoE ops (rlk.moe.v1: moe_topk, moe_grouped_linear, moe_combine and their backwards) and the MoE block on them
(rlk_core.ops.moe.layer), on the CPU: against float64 formulas; a token alone == in a batch, at any position, under
any expert load, in any token order; ties to the lower expert id; backward bitwise run to run; opcheck; bad inputs;
and the negative control — a naive torch MoE (per-expert F.linear, index_add_ combine) whose token output changes
with the batch around it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rlk_core.ops as ops
from rlk_core.errors import RlkInputError
from rlk_core.ops.moe import layer
from rlk_core.testing import assert_bitwise_equal, assert_close_to_formula, check_run_to_run

GEN = 0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _block(dtype=torch.float32, h=64, e=8, inter=32, seed=0):
    """Router and expert weights of one MoE block (scaled so activations stay O(1))."""
    g = _gen(seed)
    rw = (torch.randn(e, h, generator=g) / h ** 0.5).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(dtype)
    return rw, w13, w2


def _formula64(x, rw, w13, w2, k, normalize=True):
    """The block in float64 with torch's own softmax / topk / silu (autograd through it): the values to be close to."""
    p = torch.softmax(x @ rw.T, -1)
    wv, ids = torch.topk(p, k)
    if normalize:
        wv = wv / wv.sum(-1, keepdim=True)
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for j in range(k):
        h = torch.einsum("th,tnh->tn", x, w13[ids[:, j]])
        a = F.silu(h[:, :inter]) * h[:, inter:]
        out = out + wv[:, j, None] * torch.einsum("ti,thi->th", a, w2[ids[:, j]])
    return out, ids


# -- moe_topk ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,k", [(8, 2), (13, 3), (128, 8), (4, 4), (5, 1)])
@pytest.mark.parametrize("normalize", [True, False])
def test_topk_matches_float64(dtype, e, k, normalize):
    logits = (2 * torch.randn(33, e, generator=_gen())).to(dtype)
    w, ids = ops.moe_topk(logits, k, normalize)
    p = torch.softmax(logits.double(), -1)
    want_w, want_ids = torch.sort(p, dim=-1, descending=True, stable=True)  # bf16 logits tie: the lower id first
    want_w, want_ids = want_w[:, :k], want_ids[:, :k]
    if normalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (33, k)
    assert torch.equal(ids, want_ids)
    assert_close_to_formula(w, want_w)


def test_topk_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(4, 16)
    logits[1, [3, 11, 7]] = 2.0  # three equal maxima
    logits[2] = torch.arange(16.0).flip(0) // 4  # groups of four equal values, highest at ids 0..3
    logits[3, 9] = logits[3, 14] = 1.0
    for dtype in (torch.float32, torch.bfloat16):
        _, ids = ops.moe_topk(logits.to(dtype), 5, True)
        assert ids.tolist() == [[0, 1, 2, 3, 4], [3, 7, 11, 0, 1], [0, 1, 2, 3, 4], [9, 14, 0, 1, 2]], ids
    # logits that differ in fp32 but are equal after the router GEMM's bf16 rounding tie too
    close = torch.tensor([[1.0, 1.0 + 2 ** -10, 0.0, 1.0 + 2 ** -7]])
    assert close.bfloat16()[0, 0] == close.bfloat16()[0, 1]
    assert ops.moe_topk(close.bfloat16(), 2, True)[1].tolist() == [[3, 0]]


def test_topk_row_alone_equals_row_in_any_batch():
    logits = (3 * torch.randn(50, 64, generator=_gen(1))).bfloat16()
    w_all, ids_all = ops.moe_topk(logits, 8, True)
    for i in (0, 17, 49):
        w, ids = ops.moe_topk(logits[i:i + 1], 8, True)
        assert_bitwise_equal(w[0], w_all[i])
        assert torch.equal(ids[0], ids_all[i])
    perm = torch.randperm(50, generator=_gen(2))
    w_p, ids_p = ops.moe_topk(logits[perm], 8, True)
    assert_bitwise_equal(w_p, w_all[perm])
    assert torch.equal(ids_p, ids_all[perm])


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_backward_matches_float64_and_repeats_bitwise(normalize, dtype):
    logits = (2 * torch.randn(21, 12, generator=_gen(3))).to(dtype)
    g = torch.randn(21, 3, generator=_gen(4))

    def fwd_bwd():
        lg = logits.clone().requires_grad_()
        w, _ = ops.moe_topk(lg, 3, normalize)
        w.backward(g)
        return w, lg.grad

    ok, detail = check_run_to_run(fwd_bwd)
    assert ok, detail
    _, grad = fwd_bwd()
    l64 = logits.double().requires_grad_()
    p = torch.softmax(l64, -1)
    wv, _ = torch.topk(p, 3)
    if normalize:
        wv = wv / wv.sum(-1, keepdim=True)
    wv.backward(g.double())
    assert grad.dtype == dtype
    assert_close_to_formula(grad, l64.grad)


# -- moe_grouped_linear -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [(3, 0, 17, 16, 1), (0, 0, 0, 37, 0), (37, 0, 0, 0, 0), (0, 0, 0, 0, 0)])
def test_grouped_linear_forward_backward_match_float64(dtype, counts):
    m = sum(counts)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    x = torch.randn(m, 40, generator=_gen(5)).to(dtype)
    w = (torch.randn(5, 24, 40, generator=_gen(6)) / 6).to(dtype)
    seg = torch.repeat_interleave(torch.arange(5), torch.tensor(counts))
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = ops.moe_grouped_linear(xx, ww, offsets)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = torch.einsum("mk,mnk->mn", x64, w64[seg])
    assert y.shape == (m, 24) and y.dtype == dtype
    assert_close_to_formula(y, y64)
    gy = torch.randn(m, 24, generator=_gen(7)).to(dtype)
    y.backward(gy)
    y64.backward(gy.double())
    assert_close_to_formula(xx.grad, x64.grad)
    assert_close_to_formula(ww.grad, w64.grad)
    assert all(not ww.grad[e].any() for e in range(5) if counts[e] == 0)  # an expert without rows: zeros


def test_grouped_linear_row_depends_only_on_its_row_and_expert():
    """The same row under every load of its expert and of the others, at every place in its group: the same bits."""
    w = (torch.randn(4, 48, 72, generator=_gen(8)) / 8).bfloat16()
    probe = torch.randn(1, 72, generator=_gen(9)).bfloat16()
    want = ops.moe_grouped_linear(probe, w, torch.tensor([0, 0, 1, 1, 1]))[0]  # alone, expert 1
    crowd = torch.randn(100, 72, generator=_gen(10)).bfloat16()
    for before, after, others in ((0, 0, 99), (5, 0, 30), (0, 64, 0), (63, 36, 0), (17, 2, 81)):
        x = torch.cat([crowd[:others], crowd[others:others + before], probe, crowd[:after]])
        offsets = torch.tensor([0, others, others + before + 1 + after, x.shape[0], x.shape[0]])
        got = ops.moe_grouped_linear(x, w, offsets)[others + before]
        assert_bitwise_equal(got, want, f"before={before} after={after} others={others}")


def test_grouped_linear_negative_control_a_blas_grouped_gemm_depends_on_the_load():
    """Per-expert torch.matmul (what a naive grouped GEMM does) gives the probe row other bits when its expert has more
    rows (fp32 on this CPU's BLAS); the rlk op does not."""
    w = torch.randn(2, 64, 256, generator=_gen(11))
    x = torch.randn(64, 256, generator=_gen(12))
    alone = x[:1] @ w[0].T
    loaded = (x @ w[0].T)[:1]
    assert not torch.equal(alone, loaded), "the control did not show a load-dependent BLAS GEMM on this machine"
    assert_bitwise_equal(ops.moe_grouped_linear(x[:1], w, torch.tensor([0, 1, 1]))[0],
                         ops.moe_grouped_linear(x, w, torch.tensor([0, 64, 64]))[0])


# -- moe_combine ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_forward_backward_match_float64(dtype):
    o = torch.randn(9, 4, 70, generator=_gen(13)).to(dtype)
    w = torch.rand(9, 4, generator=_gen(14))
    oo, ww = o.clone().requires_grad_(), w.clone().requires_grad_()
    y = ops.moe_combine(oo, ww)
    o64, w64 = o.double().requires_grad_(), w.double().requires_grad_()
    y64 = (o64 * w64[:, :, None]).sum(1)
    assert_close_to_formula(y, y64)
    g = torch.randn(9, 70, generator=_gen(15)).to(dtype)
    y.backward(g)
    y64.backward(g.double())
    assert_close_to_formula(oo.grad, o64.grad)
    assert_close_to_formula(ww.grad, w64.grad, dtype=dtype)


def test_combine_sums_the_slots_left_to_right_in_fp32_with_one_rounding():
    o = torch.tensor([[[1.0], [2.0 ** -24], [2.0 ** -24]]]).bfloat16()
    w = torch.ones(1, 3)
    # fp32 (1 + 2^-24) + 2^-24 = 1 (each add rounds to even); the slots in another order would give 1 + 2^-23
    assert ops.moe_combine(o, w).float().item() == 1.0
    assert ops.moe_combine(o.flip(1), w).float().item() == 1.0  # bf16 output of 1 + 2^-23 is 1 too: one rounding
    of = o.float()
    assert ops.moe_combine(of, w).item() == 1.0 and ops.moe_combine(of.flip(1), w).item() == 1.0 + 2.0 ** -23


# -- the block --------------------------------------------------------------------------------------------------------
def _crowd(probe_ids, pool, rw, k, same: bool, n: int):
    """``n`` tokens of ``pool`` whose experts all lie inside (``same``) or outside the probe's experts."""
    _, ids = ops.moe_topk(ops.linear(pool, rw), k, True)
    mine = torch.isin(ids, probe_ids).all(1) if same else ~torch.isin(ids, probe_ids).any(1)
    picked = pool[mine][:n]
    assert picked.shape[0] == n, (same, int(mine.sum()))
    return picked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_token_alone_equals_token_in_any_batch_load_and_order(dtype):
    h, e, k = 64, 8, 2
    rw, w13, w2 = _block(dtype, h, e)
    probe = torch.randn(1, h, generator=_gen(20)).to(dtype)
    want, ids = layer.moe_ffn(probe, rw, w13, w2, k)
    pool = torch.randn(4000, h, generator=_gen(21)).to(dtype)
    # the probe's experts crowded (up to the same pair as the probe), or left to the probe alone
    near = probe + 0.02 * torch.randn(3000, h, generator=_gen(22)).to(dtype)
    heavy = _crowd(ids[0], near, rw, k, True, 40)
    light = _crowd(ids[0], pool, rw, k, False, 40)
    for crowd in (heavy, light, torch.cat([heavy[:7], light[:30]])):
        for at in (0, 5, crowd.shape[0]):
            batch = torch.cat([crowd[:at], probe, crowd[at:]])
            y, _ = layer.moe_ffn(batch, rw, w13, w2, k)
            assert_bitwise_equal(y[at], want[0], f"at={at} of {batch.shape[0]}")
    batch = torch.cat([probe, heavy, light])
    y, _ = layer.moe_ffn(batch, rw, w13, w2, k)
    perm = torch.randperm(batch.shape[0], generator=_gen(23))
    y_p, _ = layer.moe_ffn(batch[perm], rw, w13, w2, k)
    assert_bitwise_equal(y_p, y[perm], "a permuted batch")
    x64 = batch.double()
    y64, ids64 = _formula64(x64, rw.double(), w13.double(), w2.double(), k)
    assert torch.equal(layer.moe_ffn(batch, rw, w13, w2, k)[1], ids64)
    if dtype == torch.float32:  # bf16: rounded after each GEMM and the SwiGLU, so only roughly the fp64 block
        assert_close_to_formula(y, y64)
    else:
        torch.testing.assert_close(y.double(), y64, rtol=0.05, atol=0.05)


def test_block_negative_control_a_naive_torch_moe_changes_with_the_batch():
    """Hugging Face's Qwen3-MoE arithmetic in plain torch (softmax, torch.topk, per-expert F.linear over the tokens it
    received, index_add_ of the weighted outputs): the probe token's output has other bits alone than inside a batch
    that loads its experts (fp32 on this CPU's BLAS). The rlk block on the same inputs: the same bits."""
    h, e, k = 256, 8, 2
    rw, w13, w2 = _block(torch.float32, h, e, inter=128, seed=3)
    x = torch.randn(64, h, generator=_gen(30))

    def naive(x):
        p = torch.softmax(F.linear(x, rw), -1)
        wv, ids = torch.topk(p, k)
        wv = wv / wv.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        inter = w2.shape[2]
        for ex in range(e):
            tok, slot = torch.where(ids == ex)
            if tok.numel():
                hh = F.linear(x[tok], w13[ex])
                out.index_add_(0, tok, F.linear(F.silu(hh[:, :inter]) * hh[:, inter:], w2[ex]) * wv[tok, slot, None])
        return out

    assert not torch.equal(naive(x[:1])[0], naive(x)[0]), "the control did not differ on this machine"
    assert_bitwise_equal(layer.moe_ffn(x[:1], rw, w13, w2, k)[0][0], layer.moe_ffn(x, rw, w13, w2, k)[0][0])


@pytest.mark.parametrize("normalize", [True, False])
def test_block_backward_matches_float64_and_repeats_bitwise(normalize):
    h, e, k = 32, 6, 3
    rw, w13, w2 = _block(torch.float32, h, e, inter=16, seed=4)
    x = torch.randn(23, h, generator=_gen(40))
    gy = torch.randn(23, h, generator=_gen(41))
    params = (x, rw, w13, w2)

    def fwd_bwd():
        leaves = [t.clone().requires_grad_() for t in params]
        y, _ = layer.moe_ffn(*leaves, k, normalize)
        y.backward(gy)
        return (y, *(t.grad for t in leaves))

    ok, detail = check_run_to_run(fwd_bwd, repeats=3)
    assert ok, detail
    got = fwd_bwd()
    leaves64 = [t.double().requires_grad_() for t in params]
    y64, _ = _formula64(*leaves64, k, normalize)
    y64.backward(gy.double())
    for name, a, b in zip(("y", "dx", "drouter", "dw13", "dw2"), got, (y64, *(t.grad for t in leaves64)), strict=True):
        assert_close_to_formula(a, b), name


def test_block_runs_through_the_dispatcher_and_under_inference_mode():
    rw, w13, w2 = _block(torch.bfloat16)
    x = torch.randn(9, 64, generator=_gen(50)).bfloat16()
    want, _ = layer.moe_ffn(x, rw, w13, w2, 2)
    with torch.inference_mode():
        assert_bitwise_equal(layer.moe_ffn(x, rw, w13, w2, 2)[0], want)
    logits = ops.linear(x, rw)
    w, ids = torch.ops.rlk.moe_topk(logits, 2, True)
    assert torch.equal(ids, ops.moe_topk(logits, 2, True)[1])


def test_opcheck():
    logits = torch.randn(5, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.rlk.moe_topk, (logits, 3, True))
    x, w = torch.randn(6, 16, requires_grad=True), torch.randn(3, 8, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.rlk.moe_grouped_linear, (x, w, torch.tensor([0, 2, 2, 6])))
    o, cw = torch.randn(4, 2, 8, requires_grad=True), torch.rand(4, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.rlk.moe_combine, (o, cw))


@pytest.mark.parametrize("call, match", [
    (lambda: ops.moe_topk(torch.randn(3, 4), 5, True), "top_k must be an int in"),
    (lambda: ops.moe_topk(torch.randn(3, 4, 2), 1, True), "logits must have 2 dims"),
    (lambda: ops.moe_grouped_linear(torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([0, 4])), "offsets must"),
    (lambda: ops.moe_grouped_linear(torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([0, 3, 2])), "rise from 0"),
    (lambda: ops.moe_grouped_linear(torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([0, 1, 3])), "rise from 0"),
    (lambda: ops.moe_grouped_linear(torch.randn(4, 8), torch.randn(2, 3, 7), torch.tensor([0, 1, 4])), "K=8"),
    (lambda: ops.moe_grouped_linear(torch.randn(4, 8), torch.randn(2, 3, 8).bfloat16(), torch.tensor([0, 1, 4])),
     "dtypes must match"),
    (lambda: ops.moe_combine(torch.randn(3, 2, 4), torch.rand(3, 2).bfloat16()), "weights must be float32"),
    (lambda: ops.moe_combine(torch.randn(3, 2, 4), torch.rand(3, 3)), r"weights must be float32 \[T, k\]"),
])
def test_bad_inputs(call, match):
    with pytest.raises(RlkInputError, match=match):
        call()


def test_the_moe_form_runs_under_the_ffn_module_and_reports_there():
    from rlk_core import routes
    from rlk_core.contracts import OP_CONTRACTS
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder

    plan = RoutePlan("P/P", "R/R", "P/P")
    rec = ReadbackRecorder("local", "train", plan)
    side = routes.SideRoutes(plan, "train", rec)
    logits = torch.randn(4, 8, requires_grad=True)
    w, _ = side.call("ffn", "moe_topk", logits, 2, True)
    w.sum().backward()
    got = rec.to_dict()["modules"]["ffn"]["ops"]
    assert got["moe_topk"]["contract_id"] == OP_CONTRACTS["moe_topk"] == "rlk.moe.v1"
    assert got["moe_topk"]["backend_id"] == "rlk.reference"
    assert set(routes.FORM_OPS["ffn"]) == {"moe_topk", "moe_grouped_linear", "moe_combine"}
    assert all(routes.BACKWARD_OPS[n] == n + "_backward" for n in routes.FORM_OPS["ffn"])


def test_the_block_computes_hugging_face_s_qwen3_moe_block_and_hf_s_is_the_negative_control():
    """transformers' own Qwen3MoeSparseMoeBlock with the same weights — its gate (``[E, H]``) and its experts'
    ``gate_up_proj [E, 2I, H]`` (gate rows first) / ``down_proj [E, H, I]``, the layout of ``moe_ffn``: the rlk block
    is within fp32 tolerance of it; HF's token output changes when the batch around the token changes (per-expert
    F.linear over the tokens each expert received, index_add_: fp32 on this CPU's BLAS), the rlk block's does not."""
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True)
    hf = qwen3_moe.Qwen3MoeSparseMoeBlock(cfg).eval()
    rw, w13, w2 = _block(torch.float32, 256, 8, inter=128, seed=5)
    with torch.no_grad():
        hf.gate.weight.copy_(rw)
        hf.experts.gate_up_proj.copy_(w13)
        hf.experts.down_proj.copy_(w2)
    x = torch.randn(64, 256, generator=_gen(60))
    with torch.no_grad():
        want = hf(x[None])[0]
        alone = hf(x[None, :1])[0]
    got, _ = layer.moe_ffn(x, rw, w13, w2, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(alone[0], want[0]), "the HF control did not differ on this machine"
    assert_bitwise_equal(layer.moe_ffn(x[:1], rw, w13, w2, 2)[0][0], got[0])


def test_grouped_linear_takes_megatron_s_grouped_mlp_weights_as_views():
    """GroupedMLP's ``weight1 [H, E*2I]`` / ``weight2 [E*I, H]`` seen as ``[E, 2I, H]`` / ``[E, H, I]`` without a copy:
    the same bits as the contiguous weights, and the gradient lands in the stored parameter's layout."""
    e, h, inter = 4, 32, 8
    w1 = torch.randn(h, e * 2 * inter, generator=_gen(70)).bfloat16().requires_grad_()
    x = torch.randn(10, h, generator=_gen(71)).bfloat16()
    off = torch.tensor([0, 3, 3, 9, 10])
    view = w1.view(h, e, 2 * inter).permute(1, 2, 0)
    assert not view.is_contiguous()
    y = ops.moe_grouped_linear(x, view, off)
    assert_bitwise_equal(y, ops.moe_grouped_linear(x, view.detach().contiguous(), off))
    y.float().sum().backward()
    w_c = view.detach().contiguous().requires_grad_()
    ops.moe_grouped_linear(x, w_c, off).float().sum().backward()
    assert w1.grad.shape == w1.shape
    assert_bitwise_equal(w1.grad.view(h, e, 2 * inter).permute(1, 2, 0), w_c.grad)
