"""Contract ``rlk.logp.processed.v1``: the kept set of top-k / top-p / min-p sampling and the processed
log-probs (``token_logprobs`` / ``linear_logprobs`` with ``kept=``).

The kept set is checked against an independent float64 oracle (a plain sort and a sequential cumulative sum),
on rows whose top-p boundary is not within rounding of the target mass; the contract's own structure (paths,
batch invariance, shards, fused == unfused, threshold == mask) is checked bit for bit. Negative controls: the
renormalised full-vocabulary log-prob (what a trainer that replays the kept set without the contract computes)
differs in bits from the processed op, and the unfiltered recompute differs by ``log(sum_K p)``.
"""

from __future__ import annotations

import pytest
import torch

from rlk_core.errors import RlkInputError
from rlk_core.ops import _logp_tree as L
from rlk_core.ops import apply_kept, kept_set
from rlk_core.ops.kept_set import kept_mask
from rlk_core.ops.kept_set.reference import PATH_MIN_P, PATH_SORT, PATH_TOP_K, kept_set_reference
from rlk_core.ops.linear import linear
from rlk_core.ops.linear_logprobs import linear_logp_partials, linear_logprobs
from rlk_core.ops.token_logprobs import logp_partials, merge_logp_partials, token_logprobs

NEG_INF = float("-inf")


def _rows(t, v, seed=0, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, v, generator=g) * scale).to(dtype), torch.rand(t, generator=g) + 0.5


def _oracle(logits, temp, top_k, top_p, min_p):
    """Per row, in float64 with a sequential cumulative sum: the kept token ids (a set) and the top-p margin
    (how close the boundary mass is to the target; tiny margins are where fp32 and fp64 may disagree)."""
    out, margins = [], []
    z32 = logits.float() / temp[:, None] + 0.0
    for i in range(logits.shape[0]):
        z = z32[i].double()
        v = z.shape[0]
        order = sorted(range(v), key=lambda j: (-z[j].item(), j))
        zmax = z[order[0]].item()
        keep = [j for j in order if z32[i, j].item() >= (torch.tensor(zmax, dtype=torch.float32)
                                                          + torch.log(torch.tensor(min_p[i]))).item()]
        k = top_k[i]
        if 1 <= k < v:
            keep = keep[:k]
        margin = float("inf")
        if top_p[i] < 1.0:
            e = [torch.exp(z[j] - zmax).item() for j in keep]
            total, acc, n = sum(e), 0.0, len(keep)
            for idx, x in enumerate(e):
                acc += x
                if acc >= top_p[i] * total:
                    n = idx + 1
                    margin = min(acc - top_p[i] * total, top_p[i] * total - (acc - x)) / total
                    break
            keep = keep[:n]
        out.append(set(keep))
        margins.append(margin)
    return out, margins


def _kept_ids(logits, temp, ks):
    mask = kept_mask(logits, temp, ks)
    return [set(torch.nonzero(mask[i])[:, 0].tolist()) for i in range(logits.shape[0])]


PARAMS = [  # (top_k, top_p, min_p)
    (0, 1.0, 0.0), (40, 0.95, 0.0), (0, 0.9, 0.0), (5, 1.0, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.05),
    (40, 0.95, 0.05), (10 ** 6, 0.5, 0.0), (3, 0.01, 0.0), (0, 1e-6, 0.0), (2000, 0.99, 0.2),
]


@pytest.mark.parametrize("v", (1000, 1033, 300))
def test_matches_float64_oracle(v):
    logits, temp = _rows(len(PARAMS), v, seed=v)
    top_k, top_p, min_p = ([p[i] for p in PARAMS] for i in range(3))
    ks = kept_set(logits, temp, top_k, top_p, min_p)
    want, margins = _oracle(logits, temp, top_k, top_p, min_p)
    got = _kept_ids(logits, temp, ks)
    for i, (g, w, m) in enumerate(zip(got, want, margins, strict=True)):
        if m < 1e-5:
            continue  # the fp32 contract sum and the fp64 oracle may round to different sides here
        assert g == w, (i, PARAMS[i], len(g), len(w))
        assert int(ks.size[i]) == len(w)


def test_edge_cases():
    v = 600
    # all-equal logits: ties by id ascending
    x = torch.zeros(4, v)
    ks = kept_set(x, 1.0, [5, 0, 0, 1], [1.0, 0.5, 1.0, 1.0], [0.0, 0.0, 0.5, 0.0])
    assert _kept_ids(x, torch.ones(4), ks)[0] == set(range(5))
    assert _kept_ids(x, torch.ones(4), ks)[1] == set(range(300))  # mass 1/600 each: the first 300 reach 0.5
    assert ks.size[2] == v and ks.value[2] == NEG_INF and ks.token_id[2] == v - 1  # min-p keeps all equal values
    assert _kept_ids(x, torch.ones(4), ks)[3] == {0}
    # ties at the top-k boundary: the lower ids win
    y = torch.arange(v, dtype=torch.float32).neg()
    y[10:20] = 5.0
    ks = kept_set(y[None], 1.0, top_k=3)
    assert _kept_ids(y[None], torch.ones(1), ks)[0] == {10, 11, 12}
    # -inf logits (vocab padding) are never kept unless everything is; top_k >= V and top_p 1 keep everything
    z = torch.randn(2, v)
    z[:, 500:] = NEG_INF
    ks = kept_set(z, 0.7, [0, 1000], [0.999999, 1.0], 0.0)
    assert max(_kept_ids(z, torch.full((2,), 0.7), ks)[0]) < 500
    assert ks.size[1] == v and ks.value[1] == NEG_INF
    # a row of -inf only: one token kept, no NaN
    w = torch.full((1, v), NEG_INF)
    ks = kept_set(w, 1.0, top_p=0.5)
    assert ks.size[0] == 1 and not torch.isnan(ks.value).any()
    # -0.0 is +0.0 in the order
    u = torch.zeros(1, 8)
    u[0, 3] = -0.0
    ks = kept_set(u, 1.0, top_k=4)
    assert _kept_ids(u, torch.ones(1), ks)[0] == {0, 1, 2, 3}


def test_paths_give_the_same_bits():
    """topk on unique keys, the full sort and the min-p-only path: one result."""
    logits, temp = _rows(6, 1500, seed=3)
    k = torch.tensor([40, 7, 1, 300, 40, 299])
    p = torch.tensor([0.95, 1.0, 0.5, 0.8, 0.01, 0.99])
    m = torch.tensor([0.0, 0.05, 0.0, 0.1, 0.0, 0.0])
    a = kept_set_reference(logits, temp, k, p, m, PATH_TOP_K, 1499)
    b = kept_set_reference(logits, temp, k, p, m, PATH_SORT, 0)
    c = kept_set_reference(logits, temp, k, p, m, PATH_TOP_K, 300)
    for x, y in ((a, b), (a, c)):
        assert all(torch.equal(u, w) for u, w in zip(x, y, strict=True))
    zero_k, one_p = torch.zeros(6, dtype=torch.int64), torch.ones(6)
    d = kept_set_reference(logits, temp, zero_k, one_p, m, PATH_MIN_P, 0)
    e = kept_set_reference(logits, temp, zero_k, one_p, m, PATH_SORT, 0)
    assert all(torch.equal(u, w) for u, w in zip(d, e, strict=True))


def test_kept_set_is_batch_invariant():
    logits, temp = _rows(9, 2000, seed=5)
    k = [40, 0, 5, 0, 40, 1, 0, 100, 3]
    p = [0.95, 0.9, 1.0, 1.0, 0.5, 1.0, 0.3, 0.99, 0.7]
    m = [0.0, 0.0, 0.0, 0.05, 0.02, 0.0, 0.0, 0.0, 0.0]
    whole = kept_set(logits, temp, k, p, m)
    for i in range(9):  # a row alone: another path may run (topk vs sort), the bits are the same
        one = kept_set(logits[i:i + 1], temp[i:i + 1], k[i], p[i], m[i])
        assert torch.equal(one.value, whole.value[i:i + 1]) and torch.equal(one.token_id, whole.token_id[i:i + 1])
        assert torch.equal(one.size, whole.size[i:i + 1])
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    shuffled = kept_set(logits[perm], temp[perm], [k[j] for j in perm], [p[j] for j in perm], [m[j] for j in perm])
    assert torch.equal(shuffled.value, whole.value[perm]) and torch.equal(shuffled.token_id, whole.token_id[perm])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_processed_logprobs_threshold_equals_mask_and_shards(dtype):
    v, t = 4096 + 24, 7
    logits, temp = _rows(t, v, seed=7, dtype=dtype)
    ks = kept_set(logits, temp, [40, 0, 5, 2000, 0, 1, 40], [0.95, 0.9, 1.0, 0.5, 1.0, 1.0, 0.95],
                  [0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.05])
    mask = kept_mask(logits, temp, ks)
    # the sampled token is in the kept set; one row's target is not (-inf)
    target = torch.stack([torch.nonzero(mask[i])[-1, 0] for i in range(t)])
    outside = torch.nonzero(~mask[0])[0, 0]
    target[0] = outside
    logp, lse = token_logprobs(logits, target, temp, kept=ks)
    assert logp[0] == NEG_INF and torch.isfinite(logp[1:]).all()
    # mask form: -inf logits outside K through the unfiltered op
    masked = logits.masked_fill(~mask, NEG_INF)
    m_logp, m_lse = token_logprobs(masked, target, temp)
    assert torch.equal(logp, m_logp) and torch.equal(lse, m_lse)
    # vocab shards 2/4/8 and the partials + merge
    b = L.group_bounds(v)
    for n in (2, 4, 8):
        per = 8 // n
        shards = [logits[:, b[i * per]:b[(i + 1) * per]] for i in range(n)]
        a = token_logprobs(shards, target, temp, kept=ks)
        assert torch.equal(a[0], logp) and torch.equal(a[1], lse), n
        parts = [logp_partials(s, target, temp, b[i * per], v, kept=ks) for i, s in enumerate(shards)]
        mm, ss = torch.cat([q[0] for q in parts], 1), torch.cat([q[1] for q in parts], 1)
        zt = torch.stack([q[2] for q in parts]).amax(0)
        c = merge_logp_partials(mm, ss, zt, v)
        assert torch.equal(c[0], logp) and torch.equal(c[1], lse), n
    # a row alone == in the batch
    for i in range(t):
        one = token_logprobs(logits[i:i + 1], target[i:i + 1], temp[i:i + 1], kept=(ks.value[i:i + 1],
                                                                                   ks.token_id[i:i + 1]))
        assert torch.equal(one[0], logp[i:i + 1])
    # against float64: log_softmax over the kept set
    z = logits.double() / temp.double()[:, None]
    want = (z.masked_fill(~mask, NEG_INF).log_softmax(-1)).gather(1, target[:, None])[:, 0]
    torch.testing.assert_close(logp[1:].double(), want[1:], rtol=1e-5, atol=1e-5)


def test_negative_controls():
    """The unfiltered recompute and the renormalised full log-prob (logp_full - log sum_K p) are not the processed
    op's bits: a comparison of different semantics, or of an unfixed arithmetic, fails the bitwise check."""
    v, t = 2000, 64
    logits, temp = _rows(t, v, seed=11)
    ks = kept_set(logits, temp, 40, 0.95)
    mask = kept_mask(logits, temp, ks)
    target = torch.stack([torch.nonzero(mask[i])[0, 0] for i in range(t)])
    logp, _ = token_logprobs(logits, target, temp, kept=ks)
    full, _ = token_logprobs(logits, target, temp)
    assert not torch.equal(logp, full) and bool((logp > full).all())  # renormalised over K: larger
    z = logits.float() / temp[:, None]
    lsm = torch.log_softmax(z, -1)
    renorm = lsm.gather(1, target[:, None])[:, 0] - torch.logsumexp(lsm.masked_fill(~mask, NEG_INF), -1)
    assert not torch.equal(renorm, logp)
    torch.testing.assert_close(renorm, logp, rtol=1e-5, atol=1e-5)  # the same quantity, other bits


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_fused_equals_unfused_and_backward(dtype):
    g = torch.Generator().manual_seed(2)
    t, h, v = 6, 32, 1030
    hid = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 2 * h ** -0.5).to(dtype)
    temp = torch.rand(t, generator=g) + 0.5
    logits = linear(hid, w)
    ks = kept_set(logits, temp, [40, 0, 3, 0, 10, 0], [0.9, 0.8, 1.0, 1.0, 0.95, 0.5], [0, 0, 0, 0.1, 0, 0])
    mask = kept_mask(logits, temp, ks)
    target = torch.stack([torch.nonzero(mask[i])[-1, 0] for i in range(t)])
    a = linear_logprobs(hid, w, target, temp, kept=ks)
    b = token_logprobs(logits, target, temp, kept=ks)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    bounds = L.group_bounds(v)
    shards = [w[bounds[2 * i]:bounds[2 * i + 2]] for i in range(4)]
    assert torch.equal(linear_logprobs(hid, shards, target, temp, kept=ks)[0], a[0])
    parts = [linear_logp_partials(hid, s, target, temp, bounds[2 * i], v, kept=ks) for i, s in enumerate(shards)]
    mm, ss = torch.cat([q[0] for q in parts], 1), torch.cat([q[1] for q in parts], 1)
    assert torch.equal(merge_logp_partials(mm, ss, torch.stack([q[2] for q in parts]).amax(0), v)[0], a[0])

    def grads():
        x = logits.detach().float().requires_grad_()
        lp, lse = token_logprobs(x, target, temp, kept=ks)
        (lp * torch.linspace(1, 2, t) + 0.1 * lse).sum().backward()
        hh, ww = hid.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        lp2, _ = linear_logprobs(hh, ww, target, temp, kept=ks)
        lp2.sum().backward()
        return x.grad, hh.grad, ww.grad

    g1, g2 = grads(), grads()
    assert all(torch.equal(a_, b_) for a_, b_ in zip(g1, g2, strict=True))  # run to run
    assert bool((g1[0][~mask] == 0).all())  # the gradient flows through the kept tokens only
    # against autograd of the float64 formula over the kept set
    x64 = (logits.detach().double() / temp.double()[:, None]).masked_fill(~mask, NEG_INF).requires_grad_()
    lsm = x64.log_softmax(-1)
    (lsm.gather(1, target[:, None])[:, 0] * torch.linspace(1, 2, t).double()
     + 0.1 * torch.logsumexp(x64, -1)).sum().backward()
    want = torch.where(mask, x64.grad / temp.double()[:, None], torch.zeros_like(x64.grad))
    torch.testing.assert_close(g1[0].double(), want, rtol=1e-4, atol=1e-6)


def test_apply_kept_is_the_processed_distribution():
    logits, temp = _rows(5, 700, seed=9)
    ks = kept_set(logits, temp, 10, 0.9)
    z = apply_kept(logits, temp, ks)
    assert z.dtype == torch.float32 and bool((torch.isfinite(z).sum(-1) == ks.size).all())
    target = z.argmax(-1)
    lp, _ = token_logprobs(logits, target, temp, kept=ks)
    torch.testing.assert_close(lp, torch.log_softmax(z, -1).gather(1, target[:, None])[:, 0], rtol=1e-5, atol=1e-6)


def test_bad_inputs():
    x = torch.randn(3, 50)
    with pytest.raises(RlkInputError, match="top_p"):
        kept_set(x, 1.0, top_p=0.0)
    with pytest.raises(RlkInputError, match="top_k"):
        kept_set(x, 1.0, top_k=-2)
    with pytest.raises(RlkInputError, match="min_p"):
        kept_set(x, 1.0, min_p=1.5)
    with pytest.raises(RlkInputError, match="temperature"):
        kept_set(x, 0.0, top_p=0.5)
    with pytest.raises(RlkInputError, match="3 rows"):
        kept_set(x, 1.0, top_k=[1, 2])
    with pytest.raises(RlkInputError, match="kept"):
        token_logprobs(x, torch.zeros(3, dtype=torch.long), 1.0, kept=(torch.zeros(2), torch.zeros(2)))


def test_triton_processed_kernels_under_interpreter(run_interpreted):
    """The FILTER variants of the rlk.triton log-prob kernels: within tolerance of the reference, and bit for bit
    the unfiltered kernel on mask-filled logits, over shards and partials (the GPU invariances)."""
    run_interpreted('''
        from rlk_core.ops import _logp_tree as L
        from rlk_core.ops.kept_set import kept_set, kept_mask
        from rlk_core.ops.linear import triton as LT
        from rlk_core.ops.linear_logprobs import triton as LLT
        from rlk_core.ops.token_logprobs import triton as TT
        from rlk_core.ops.token_logprobs.reference import (processed_token_logprobs_reference,
                                                           processed_token_logprobs_backward_reference)
        g = torch.Generator().manual_seed(0)
        for t, v, dt in ((5, 1000, torch.float32), (3, 2051, torch.bfloat16)):
            x = (torch.randn(t, v, generator=g) * 4).to(dt)
            temp = torch.rand(t, generator=g) + 0.5
            ks = kept_set(x, temp, [40, 0, 5, 0, 2][:t], [0.9, 0.8, 1.0, 1.0, 0.5][:t], 0.0)
            mask = kept_mask(x, temp, ks)
            y = torch.stack([torch.nonzero(mask[i])[-1, 0] for i in range(t)])
            lp, lse = TT.processed_forward(CPU, [x], y, temp, ks.value, ks.token_id)
            un = TT.forward(CPU, [x.masked_fill(~mask, float("-inf"))], y, temp)
            assert torch.equal(lp, un[0]) and torch.equal(lse, un[1]), "threshold != mask"
            rl, rs = processed_token_logprobs_reference([x], y, temp, ks.value, ks.token_id)
            torch.testing.assert_close(lp, rl, rtol=1e-5, atol=1e-5)
            b = L.group_bounds(v)
            sh = [x[:, b[2 * i]:b[2 * i + 2]] for i in range(4)]
            a = TT.processed_forward(CPU, sh, y, temp, ks.value, ks.token_id)
            assert torch.equal(a[0], lp), "shards"
            parts = [TT.processed_logp_partials(CPU, s_, y, temp, ks.value, ks.token_id, b[2 * i], v)
                     for i, s_ in enumerate(sh)]
            m, s = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
            zt = torch.stack([p[2] for p in parts]).amax(0)
            assert torch.equal(TT.merge_logp_partials(CPU, m, s, zt, v)[0], lp), "partials"
            gl, gs = torch.randn(t, generator=g), torch.randn(t, generator=g)
            d = TT.processed_backward(CPU, [x], y, temp, ks.value, ks.token_id, lse, gl, gs)[0]
            r = processed_token_logprobs_backward_reference([x], y, temp, ks.value, ks.token_id, lse, gl, gs)[0]
            torch.testing.assert_close(d.double(), r.double(), rtol=1.6e-2, atol=1e-5)
            assert bool((d[~mask] == 0).all())
        LT.forward = lambda p, x, w, b: torch.ops.rlk.linear(x, w, b)
        LLT.CHUNK_BYTES = 5 * 4 * 512
        hid = torch.randn(4, 40, generator=g)
        w = torch.randn(1030, 40, generator=g) * 0.3
        temp = torch.rand(4, generator=g) + 0.5
        logits = torch.ops.rlk.linear(hid, w, None)
        ks = kept_set(logits, temp, [10, 0, 3, 0], [0.9, 0.7, 1.0, 1.0], [0, 0, 0, 0.1])
        y = torch.stack([torch.nonzero(kept_mask(logits, temp, ks)[i])[0, 0] for i in range(4)])
        lp, lse = LLT.processed_forward(CPU, hid, [w], y, temp, ks.value, ks.token_id)
        un = TT.processed_forward(CPU, [logits], y, temp, ks.value, ks.token_id)
        assert torch.equal(lp, un[0]) and torch.equal(lse, un[1]), "fused != unfused"
        print("ok")
    ''')


def test_triton_kept_set_under_interpreter(run_interpreted):
    """rlk.triton's kept_set (the candidates kernel + the reference's top-p) gives the reference's bits on the top-k
    path — ties at the k-th value, -inf and -0.0 logits, min-p, rows of different parameters, bf16 and fp32 — and the
    reference's own code on the other paths; the apply kernel gives the reference's processed logits; negative controls:
    candidates cut one short, a threshold one id lower change the result."""
    run_interpreted('''
        from rlk_core.ops.kept_set import reference as R
        from rlk_core.ops.kept_set import triton as KT

        def same(a, b):
            return all(torch.equal(u, w) for u, w in zip(a, b, strict=True))

        g = torch.Generator().manual_seed(7)
        for t, v, dt in ((6, 5000, torch.float32), (4, 2051, torch.bfloat16)):
            x = (torch.randn(t, v, generator=g) * 3).to(dt)
            x[0, :40] = 2.5            # ties at and around the k-th value
            x[1, 100:] = float("-inf")  # vocab padding
            x[2, 7] = -0.0
            x[2, :30] = 0.0            # zeros (one of them -0.0) tied
            temp = (torch.rand(t, generator=g) + 0.5)
            p = torch.tensor([0.95, 1.0, 0.5, 0.8, 0.01, 0.99][:t])
            m = torch.tensor([0.0, 0.05, 0.0, 0.1, 0.0, 0.3][:t])
            # kmax 300: the torch finish; <= 256: the finish kernel (one block of the top-p scan)
            for ks in ([40, 7, 30, 300, 40, 1], [40, 7, 30, 256, 40, 1], [64, 64, 64, 64, 64, 64], [2, 1, 3, 1, 2, 5]):
                k = torch.tensor(ks[:t])
                kmax = int(k.max())
                ref = R.kept_set_reference(x, temp, k, p, m, R.PATH_TOP_K, kmax)
                got = KT.kept_set(CPU, x, temp, k, p, m, R.PATH_TOP_K, kmax)
                assert same(got, ref), (ks, got, ref)
            sort = KT.kept_set(CPU, x, temp, torch.zeros(t, dtype=torch.int64), p, m, R.PATH_SORT, 0)
            assert same(sort, R.kept_set_reference(x, temp, torch.zeros(t, dtype=torch.int64), p, m, R.PATH_SORT, 0))
            # the apply kernel (two programs per row at V = 5000): the reference's processed logits, bit for bit
            for kept in (ref, (torch.full((t,), float("-inf")), torch.full((t,), v - 1, dtype=torch.int64))):
                want = R.mask_outside(R.tempered(x, temp), kept[0], kept[1])
                got = KT.apply_kept(CPU, x, temp, kept[0].contiguous(), kept[1].contiguous())
                assert torch.equal(got, want) and torch.equal(got.view(torch.int32), want.view(torch.int32))
            # negative control: the last kept id one lower drops exactly that token
            cut = KT.apply_kept(CPU, x, temp, ref[0].contiguous(), (ref[1] - 1).contiguous())
            assert not torch.equal(cut, KT.apply_kept(CPU, x, temp, ref[0].contiguous(), ref[1].contiguous()))
        # negative control: the finish given one candidate fewer (the k-th token's tie dropped) differs
        x = torch.zeros(1, 64)
        x[0, :8] = 1.0
        temp, k, p, m = torch.ones(1), torch.tensor([4]), torch.ones(1), torch.zeros(1)
        zmax, tau, minz = KT._bounds(x, temp, m, 4)
        gv, gi, ei = torch.empty(1, 4), torch.empty(1, 4, dtype=torch.int64), torch.empty(1, 4, dtype=torch.int64)
        count = torch.empty(1, 3, dtype=torch.int32)
        KT._candidates_kernel[(1,)](x, temp, tau, minz, gv, gi, ei, count, 64, 4, 64, BLOCK=KT.BLOCK)
        good = KT._finish(gv, gi, ei, count, tau, zmax, k, p, 4, 64)
        assert int(good[1][0]) == 3, good
        count[0, 1] = 3
        ei[0, :3] = ei[0, 1:].clone()
        assert int(KT._finish(gv, gi, ei, count, tau, zmax, k, p, 4, 64)[1][0]) != 3
        print("ok")
    ''')
