"""``entropy`` (contract ``rlk.entropy.v1``): the entropy of ``softmax(z / T)``, unfiltered or over a kept set.

Checked against a float64 formula (within the fp32 tolerances of ``dtype_tols``); the contract's structure bit for
bit: run to run, batch-invariant, shards == unsharded, threshold form == mask form, ``lse`` == the processed
log-prob op's. Negative controls: a plain ``torch.sum`` of the same terms, and the unfiltered entropy next to the
processed one, differ in bits.
"""

from __future__ import annotations

import pytest
import torch

from rlk_core.errors import RlkInputError
from rlk_core.ops import entropy, kept_set, token_logprobs
from rlk_core.ops.kept_set import kept_mask
from rlk_core.testing.compare import dtype_tols

NEG_INF = float("-inf")


def _rows(t, v, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, v, generator=g) * scale, torch.rand(t, generator=g) + 0.5


def _f64(logits, temp, mask=None):
    z = logits.double() / temp.double()[:, None]
    if mask is not None:
        z = z.masked_fill(~mask, NEG_INF)
    p = torch.softmax(z, -1)
    return torch.where(p > 0, -p * torch.log(p), torch.zeros_like(p)).sum(-1)


@pytest.mark.parametrize("t,v", [(1, 7), (5, 1000), (19, 1537), (3, 4099)])
def test_matches_float64_unfiltered_and_processed(t, v):
    logits, temp = _rows(t, v, seed=v)
    h, _ = entropy(logits, temp)
    torch.testing.assert_close(h.double(), _f64(logits, temp), **dtype_tols(torch.float32))
    ks = kept_set(logits, temp, top_k=min(40, v), top_p=0.9, min_p=0.02)
    hk, _ = entropy(logits, temp, kept=ks)
    torch.testing.assert_close(hk.double(), _f64(logits, temp, kept_mask(logits, temp, ks)),
                               **dtype_tols(torch.float32))
    assert (hk <= h + 1e-6).all()  # the kept set's distribution is more concentrated here


def test_singleton_kept_set_has_zero_entropy_and_padding_is_harmless():
    logits, temp = _rows(4, 300, seed=1)
    h, _ = entropy(logits, temp, kept=kept_set(logits, temp, top_k=1))
    assert torch.equal(h, torch.zeros(4))
    padded = torch.cat([logits, torch.full((4, 20), NEG_INF)], 1)  # vocab padding: -inf logits, p = 0
    hp, _ = entropy(padded, temp)
    assert torch.isfinite(hp).all()
    torch.testing.assert_close(hp.double(), _f64(logits, temp), **dtype_tols(torch.float32))


def test_bitwise_run_to_run_batch_invariant_and_sharded():
    logits, temp = _rows(13, 1600, seed=2)
    ks = kept_set(logits, temp, top_k=50, top_p=0.95)
    h, lse = entropy(logits, temp, kept=ks)
    assert torch.equal(entropy(logits, temp, kept=ks)[0], h)
    one = entropy(logits[5:6], temp[5:6], kept=(ks.value[5:6], ks.token_id[5:6]))[0]
    assert torch.equal(one, h[5:6])
    for n in (2, 4, 8):
        shards = list(logits.split(1600 // n, dim=1))
        assert torch.equal(entropy(shards, temp, kept=ks)[0], h), n
    # lse: bitwise the processed log-prob op's
    assert torch.equal(lse, token_logprobs(logits, logits.argmax(-1), temp, kept=ks)[1])
    # threshold form == mask form (-inf outside the kept set, no kept argument)
    masked = logits.masked_fill(~kept_mask(logits, temp, ks), NEG_INF)
    assert torch.equal(entropy(masked, temp)[0], h)


def test_negative_controls():
    logits, temp = _rows(64, 3000, seed=3)
    ks = kept_set(logits, temp, top_p=0.9)
    h, lse = entropy(logits, temp, kept=ks)
    z = (logits / temp[:, None]).masked_fill(~kept_mask(logits, temp, ks), NEG_INF)
    d = lse[:, None] - z
    native = torch.where(torch.isfinite(z), torch.exp(-d) * d, torch.zeros_like(z)).sum(-1)  # torch's own sum order
    assert not torch.equal(native, h)
    torch.testing.assert_close(native, h, **dtype_tols(torch.float32))
    assert not torch.equal(entropy(logits, temp)[0], h)  # unfiltered != processed


def test_backward_matches_float64_and_is_bitwise_run_to_run():
    logits, temp = _rows(6, 700, seed=4)
    ks = kept_set(logits, temp, top_k=30, top_p=0.9)
    keep = kept_mask(logits, temp, ks)
    w = torch.randn(6, generator=torch.Generator().manual_seed(9))

    def grad():
        x = logits.clone().requires_grad_()
        (entropy(x, temp, kept=ks)[0] * w).sum().backward()
        return x.grad

    g1 = grad()
    assert torch.equal(g1, grad())
    assert torch.equal(g1[~keep], torch.zeros_like(g1[~keep]))  # the gradient flows through the kept tokens only
    want = torch.zeros(logits.shape, dtype=torch.float64)
    for i in range(6):  # float64 autograd over each row's kept columns only
        x = logits[i, keep[i]].double().requires_grad_()
        logp = torch.log_softmax(x / temp[i].double(), -1)
        (-(logp.exp() * logp).sum() * w[i].double()).backward()
        want[i, keep[i]] = x.grad
    torch.testing.assert_close(g1.double(), want, **dtype_tols(torch.float32))
    sharded = [s.clone().requires_grad_() for s in logits.split(350, dim=1)]
    (entropy(sharded, temp, kept=ks)[0] * w).sum().backward()
    assert torch.equal(torch.cat([s.grad for s in sharded], 1), g1)


def test_opcheck_and_bad_inputs():
    logits, temp = _rows(5, 600, seed=5)
    ks = kept_set(logits, temp, top_k=20)
    torch.library.opcheck(torch.ops.rlk.entropy.default, ([logits.clone().requires_grad_()], temp, ks.value,
                                                          ks.token_id))
    with pytest.raises(RlkInputError, match="entropy"):
        entropy(logits.long(), 1.0)
    with pytest.raises(RlkInputError, match="kept"):
        entropy(logits, 1.0, kept=(ks.value[:2], ks.token_id[:2]))
    with pytest.raises(RlkInputError, match="temperature"):
        entropy(logits, 0.0)
