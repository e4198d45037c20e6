"""Contract ``rlk.logp.processed.v1`` on the GPU: the kept set (torch on CUDA) batch-invariant and equal to the
CPU's, the processed log-prob kernels (``FILTER``) bitwise equal to the unfiltered kernels on mask-filled logits
(threshold == mask), over vocab shards, fused == unfused, rows alone == in a batch, run to run, and within
tolerance of the reference; negative control: vLLM-style torch filtering (sort + softmax + cumsum) with
``log_softmax`` is not those bits."""

from __future__ import annotations

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import _logp_tree as L
from rlk_core.ops import kept_set
from rlk_core.ops.kept_set import kept_mask
from rlk_core.ops.linear import linear
from rlk_core.ops.linear_logprobs import linear_logprobs
from rlk_core.ops.token_logprobs import token_logprobs

from ._shapes import gen, randn

pytestmark = pytest.mark.gpu

VOCAB = 151936
PARAMS = dict(top_k=[40, 0, 40, 5, 0, 1000, 40, 0], top_p=[0.95, 0.9, 1.0, 1.0, 0.5, 0.99, 0.95, 1.0],
              min_p=[0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.05, 0.1])


def _rows(t, v=VOCAB, seed=1):
    x = randn((t, v), torch.bfloat16, 3.0, seed)
    temp = 0.5 + torch.rand(t, device="cuda", generator=gen(seed + 1))
    return x, temp


def _params(t):
    return {k: (v * (t // len(v) + 1))[:t] for k, v in PARAMS.items()}


def _targets(x, temp, ks):
    mask = kept_mask(x, temp, ks)
    idx = torch.arange(x.shape[1], device="cuda")
    return torch.where(mask, idx, -1).amax(-1)  # the kept token of the largest id: always in the kept set


def test_processed_backends_are_the_kernels():
    x, temp = _rows(4)
    ks = kept_set(x, temp, **_params(4))
    y = _targets(x, temp, ks)
    sel = REGISTRY.select("processed_token_logprobs", "cuda", ([x], y, temp, ks.value, ks.token_id), True)
    assert sel.backend.id in ("rlk.triton", "rlk.cuda") and sel.fallback_reason is None


@pytest.mark.parametrize("t", (1, 7, 64, 257))
def test_kept_set_is_batch_invariant_and_equals_the_cpu(t):
    x, temp = _rows(t)
    p = _params(t)
    ks = kept_set(x, temp, **p)
    for i in range(min(t, 8)):
        one = kept_set(x[i:i + 1], temp[i:i + 1], p["top_k"][i], p["top_p"][i], p["min_p"][i])
        assert torch.equal(one.value, ks.value[i:i + 1]) and torch.equal(one.token_id, ks.token_id[i:i + 1])
    cpu = kept_set(x.cpu(), temp.cpu(), **p)
    # the same torch code; torch.exp on CUDA need not be the CPU's, so the top-p cut may differ at a boundary
    same = (cpu.size == ks.size.cpu()).float().mean()
    assert same >= 0.95, same
    assert torch.equal(cpu.size[torch.tensor(p["top_p"]) == 1.0], ks.size.cpu()[torch.tensor(p["top_p"]) == 1.0])


@pytest.mark.parametrize("t", (1, 9, 336))
def test_kept_set_top_k_kernel_equals_the_reference(t):
    """The top-k path on rlk.triton / rlk.cuda (the candidates kernel) == the reference's torch ops on the same GPU,
    bit for bit, at the seeds' settings and with ties at the k-th value; rows alone == in the batch."""
    from rlk_core.ops.kept_set.reference import PATH_TOP_K, kept_set_reference

    x, temp = _rows(t, seed=11)
    x[0, :64] = 2.0  # a tie group across the k-th value
    k = torch.tensor(([40, 40, 20, 1, 64] * t)[:t], device="cuda")
    p = torch.tensor(([0.95, 0.8, 1.0, 1.0, 0.99] * t)[:t], device="cuda")
    m = torch.tensor(([0.0, 0.05, 0.0, 0.0, 0.1] * t)[:t], device="cuda")
    sel = REGISTRY.select("kept_set", "cuda", (x, temp, k, p, m, PATH_TOP_K, 64), True)
    assert sel.backend.id in ("rlk.triton", "rlk.cuda") and sel.fallback_reason is None
    ks = kept_set(x, temp, k, p, m, host=(k.tolist(), p.tolist(), m.tolist()))
    ref = kept_set_reference(x, temp, k, p, m, PATH_TOP_K, 64)
    assert torch.equal(ks.value, ref[0]) and torch.equal(ks.token_id, ref[1]) and torch.equal(ks.size, ref[2])
    for i in range(min(t, 5)):
        one = kept_set(x[i:i + 1], temp[i:i + 1], int(k[i]), float(p[i]), float(m[i]))
        assert torch.equal(one.value, ks.value[i:i + 1]) and torch.equal(one.token_id, ks.token_id[i:i + 1])


@pytest.mark.parametrize("t", (1, 9, 336))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_apply_kept_kernel_equals_the_reference(t, dtype):
    """``apply_kept`` on rlk.triton (one pass) == the reference's torch ops on the same GPU, bit for bit, with -0.0,
    -inf and tied logits, a whole-vocabulary row; rows alone == in the batch. Negative control: the same kernel with
    the threshold's id one lower drops a kept token."""
    from rlk_core.ops.kept_set import apply_kept
    from rlk_core.ops.kept_set.reference import mask_outside, tempered

    x, temp = _rows(t, seed=13)
    x = x.to(dtype)
    x[0, :64] = 2.0
    x[0, 100] = -0.0
    x[-1, VOCAB - 300:] = float("-inf")
    ks = kept_set(x, temp, **_params(t))
    value, token_id = ks.value.clone(), ks.token_id.clone()
    value[-1], token_id[-1] = float("-inf"), VOCAB - 1  # the whole vocabulary
    sel = REGISTRY.select("apply_kept", "cuda", (x, temp, value, token_id), True)
    assert sel.backend.id in ("rlk.triton", "rlk.cuda") and sel.fallback_reason is None
    got = apply_kept(x, temp, (value, token_id))
    want = mask_outside(tempered(x, temp), value, token_id)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for i in range(min(t, 4)):
        one = apply_kept(x[i:i + 1], temp[i:i + 1], (value[i:i + 1], token_id[i:i + 1]))
        assert torch.equal(one.view(torch.int32), got[i:i + 1].view(torch.int32))
    cut = apply_kept(x, temp, (ks.value, ks.token_id - 1))
    assert not torch.equal(cut, apply_kept(x, temp, ks))


@pytest.mark.parametrize("t", (1, 16, 300))
def test_processed_token_logprobs_threshold_equals_mask_and_shards(t):
    x, temp = _rows(t, seed=3)
    ks = kept_set(x, temp, **_params(t))
    y = _targets(x, temp, ks)
    logp, lse = token_logprobs(x, y, temp, kept=ks)
    assert torch.isfinite(logp).all()
    m_logp, m_lse = token_logprobs(x.masked_fill(~kept_mask(x, temp, ks), float("-inf")), y, temp)
    assert torch.equal(logp, m_logp) and torch.equal(lse, m_lse)
    b = L.group_bounds(VOCAB)
    for n in (2, 4, 8):
        per = 8 // n
        shards = [x[:, b[i * per]:b[(i + 1) * per]] for i in range(n)]
        a = token_logprobs(shards, y, temp, kept=ks)
        assert torch.equal(a[0], logp) and torch.equal(a[1], lse), n
    for i in range(min(t, 5)):
        one = token_logprobs(x[i:i + 1], y[i:i + 1], temp[i:i + 1], kept=(ks.value[i:i + 1], ks.token_id[i:i + 1]))
        assert torch.equal(one[0], logp[i:i + 1])
    z = x.double() / temp.double()[:, None]
    want = z.masked_fill(~kept_mask(x, temp, ks), float("-inf")).log_softmax(-1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), want, rtol=1e-5, atol=1e-5)


def test_processed_linear_logprobs_fused_equals_unfused_and_backward():
    t, h = 96, 1024
    hid = randn((t, h), torch.bfloat16, 1.0, 5)
    w = randn((VOCAB, h), torch.bfloat16, 2.0 * h ** -0.5, 6)
    temp = 0.5 + torch.rand(t, device="cuda", generator=gen(7))
    logits = linear(hid, w)
    ks = kept_set(logits, temp, **_params(t))
    y = _targets(logits, temp, ks)
    a = linear_logprobs(hid, w, y, temp, kept=ks)
    b = token_logprobs(logits, y, temp, kept=ks)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    shards = list(w.split(VOCAB // 4))
    assert torch.equal(linear_logprobs(hid, shards, y, temp, kept=ks)[0], a[0])

    def grads():
        hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
        lp, _ = linear_logprobs(hh, ww, y, temp, kept=ks)
        lp.sum().backward()
        return hh.grad, ww.grad

    g1, g2 = grads(), grads()
    assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])
    # the weight rows of tokens outside every row's kept set get no gradient
    outside = ~kept_mask(logits, temp, ks).any(0)
    assert bool((g1[1][outside] == 0).all())


def test_negative_control_native_filter():
    """vLLM's torch top-k/top-p path (sort ascending, softmax, cumsum, mask) and log_softmax: not the contract's
    bits, though the same semantics where the two kept sets agree. They need not: bf16 logits tie often, and vLLM
    keeps every token tied at the k-th value and cuts ties at top-p in its sort's order, while the contract
    breaks ties by token id."""
    t = 64
    x, temp = _rows(t, seed=9)
    ks = kept_set(x, temp, top_k=40, top_p=0.95)
    y = _targets(x, temp, ks)
    logp, _ = token_logprobs(x, y, temp, kept=ks)
    z = x.float() / temp[:, None]
    top = torch.topk(z, 40, dim=-1).values[:, -1:]
    z = z.masked_fill(z < top, float("-inf"))
    s, idx = z.sort(dim=-1)
    cut = s.softmax(-1).cumsum(-1) <= 1 - 0.95
    cut[:, -1] = False
    zn = z.scatter(-1, idx, s.masked_fill(cut, float("-inf")))
    native = zn.log_softmax(-1).gather(1, y[:, None])[:, 0]
    assert not torch.equal(native, logp)
    same = torch.isfinite(zn).sum(-1) == ks.size  # rows whose two kept sets have the same size
    assert int(same.sum()) >= 8, int(same.sum())
    torch.testing.assert_close(native[same], logp[same], rtol=1e-4, atol=1e-4)
