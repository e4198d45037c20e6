"""``token_logprobs`` (contract ``rlk.logp.v1``): reference vs float64, bitwise invariances, backward,
opcheck, bad inputs, and the negative control for the vocab-parallel merge.

Negative control note: ``torch.log_softmax`` alone was measured batch-invariant on this CPU
(``shared/reference/h200-facts.md``), so the unfused logp's batch-invariance control comes from the
GEMM (see ``test_linear_logprobs.py``). What the naive composition *does* break on the CPU is the
vocab-parallel merge: per-shard ``torch.logsumexp`` followed by a ``logsumexp`` of the shard results
differs from the unsharded ``torch.logsumexp`` (``test_negative_control_naive_shard_merge``).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk_core.errors import RlkInputError
from rlk_core.ops import _logp_tree as L
from rlk_core.ops.token_logprobs import logp_partials, merge_logp_partials, token_logprobs
from rlk_core.testing import (
    assert_bitwise_equal,
    assert_close_to_formula,
    check_batch_invariance,
    check_run_to_run,
    dtype_tols,
)
from rlk_core.testing.logp import check_vocab_shard_merge, shard_bounds

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# V: not a multiple of 8*256; 4096 + 24 (groups of 515 = 2 blocks + 3); a Qwen3-sized vocab
VOCABS = (1000, 4096 + 24)
QWEN3_VOCAB = 151936


def _inputs(t: int, v: int, dtype=torch.float32, seed: int = 0, scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g) * scale).to(dtype)
    target = torch.randint(0, v, (t,), generator=g)
    temp = torch.rand(t, generator=g) + 0.5
    return logits, target, temp


def _formula64(logits: torch.Tensor, target: torch.Tensor, temp: torch.Tensor | float):
    t32 = temp.float() if isinstance(temp, torch.Tensor) else torch.tensor(temp, dtype=torch.float32)
    z = logits.double() / (t32.double()[:, None] if t32.dim() else t32.double())
    lse = torch.logsumexp(z, -1)
    return z.gather(1, target[:, None])[:, 0] - lse, lse


# -- reference vs float64 --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", (*VOCABS, 1, 7))
def test_matches_float64(dtype, v):
    logits, target, temp = _inputs(19, v, dtype)
    for temperature in (temp, 0.7):
        logp, lse = token_logprobs(logits, target, temperature)
        assert logp.dtype == lse.dtype == torch.float32 and logp.shape == (19,)
        want_logp, want_lse = _formula64(logits, target, temperature)
        # the logits are the input: everything after them is fp32 arithmetic
        assert_close_to_formula(logp, want_logp, torch.float32, "logp")
        assert_close_to_formula(lse, want_lse, torch.float32, "lse")


def test_qwen3_sized_vocab_matches_float64_and_shards():
    logits, target, temp = _inputs(3, QWEN3_VOCAB, torch.bfloat16)
    logp, lse = token_logprobs(logits, target, temp)
    want_logp, want_lse = _formula64(logits, target, temp)
    assert_close_to_formula(logp, want_logp, torch.float32, "logp")
    assert_close_to_formula(lse, want_lse, torch.float32, "lse")
    ok, detail = check_vocab_shard_merge(logits, target, temp)
    assert ok, detail


def test_masked_logits_are_exact_identities():
    # -inf columns (top-k / top-p masking) contribute nothing; whole masked blocks and groups are
    # identities, no NaN appears.
    logits, target, temp = _inputs(4, 4096 + 24)
    logits[:, 600:3000] = float("-inf")  # blocks and whole groups masked
    logits[0, :] = float("-inf")
    logits[0, 4100] = 1.5
    target[:] = torch.tensor([4100, 5, 3500, 4119])
    logp, lse = token_logprobs(logits, target, temp)
    assert torch.isfinite(logp).all() and torch.isfinite(lse).all()
    assert logp[0].item() == 0.0 and lse[0].item() == (torch.tensor(1.5) / temp[0]).item()
    want_logp, want_lse = _formula64(logits, target, temp)
    assert_close_to_formula(logp, want_logp, torch.float32, "logp")
    assert_close_to_formula(lse, want_lse, torch.float32, "lse")
    ok, detail = check_vocab_shard_merge(logits, target, temp)
    assert ok, detail


# -- bitwise invariances ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("v", VOCABS)
def test_batch_invariant(dtype, v):
    logits, target, temp = _inputs(64, v, dtype)

    def fn(idx: torch.Tensor) -> torch.Tensor:
        i = idx[:, 0]
        return torch.stack(token_logprobs(logits[i], target[i], temp[i]), -1)

    rows = torch.arange(64)[:, None]
    for probe in (0, 37, 63):
        ok, detail = check_batch_invariance(fn, rows, batch_sizes=(1, 2, 3, 5, 7, 16, 31, 33, 48, 64), probe=probe)
        assert ok, detail


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("v", (*VOCABS, 8 * 2600 + 8, 9))
def test_vocab_shards_1_2_4_8_bitwise(dtype, v):
    logits, target, temp = _inputs(17, v, dtype, seed=v)
    ok, detail = check_vocab_shard_merge(logits, target, temp)
    assert ok, detail
    ok, detail = check_vocab_shard_merge(logits, target, 1.3)
    assert ok, detail


def test_run_to_run_forward_and_backward():
    logits, target, temp = _inputs(33, 4096 + 24)

    def fwd_bwd():
        x = logits.clone().requires_grad_()
        logp, lse = token_logprobs(x, target, temp)
        (logp.sum() * 0.5 + (lse * torch.linspace(0, 1, 33)).sum()).backward()
        return logp, lse, x.grad

    ok, detail = check_run_to_run(fwd_bwd, repeats=10)
    assert ok, detail


def test_non_contiguous_logits_equal_contiguous():
    logits, target, temp = _inputs(9, 1000)
    strided = logits.t().contiguous().t()
    assert not strided.is_contiguous()
    for a, b in zip(token_logprobs(strided, target, temp), token_logprobs(logits, target, temp), strict=True):
        assert_bitwise_equal(a, b)


def test_temperature_scalar_equals_per_row_tensor():
    logits, target, _ = _inputs(5, 1000)
    a = token_logprobs(logits, target, 0.7)
    b = token_logprobs(logits, target, torch.full((5,), 0.7))
    c = token_logprobs(logits, target, torch.tensor(0.7, dtype=torch.float64))
    for x, y, w in zip(a, b, c, strict=True):
        assert_bitwise_equal(x, y)
        assert_bitwise_equal(x, w)


def test_empty_batch():
    logits, target, temp = _inputs(0, 1000)
    logp, lse = token_logprobs(logits.requires_grad_(), target, temp)
    assert logp.shape == lse.shape == (0,)
    (logp.sum() + lse.sum()).backward()
    assert logits.grad.shape == (0, 1000)


# -- backward ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(dtype):
    logits, target, temp = _inputs(11, 1000, dtype, scale=2.0)
    g_logp, g_lse = torch.randn(11), torch.randn(11)
    x = logits.clone().requires_grad_()
    logp, lse = token_logprobs(x, target, temp)
    torch.autograd.backward((logp, lse), (g_logp, g_lse))
    x64 = logits.double().requires_grad_()
    want_logp, want_lse = _formula64(x64, target, temp)
    torch.autograd.backward((want_logp, want_lse), (g_logp.double(), g_lse.double()))
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), x64.grad, **dtype_tols(dtype))


def test_backward_through_shards_equals_unsharded():
    logits, target, temp = _inputs(7, 8 * 300)
    x = logits.clone().requires_grad_()
    logp, lse = token_logprobs(x, target, temp)
    (logp.sum() + lse.sum()).backward()
    parts = [logits[:, a:e].clone().requires_grad_() for a, e in shard_bounds(8 * 300, 4)]
    logp2, lse2 = token_logprobs(parts, target, temp)
    (logp2.sum() + lse2.sum()).backward()
    assert_bitwise_equal(torch.cat([p.grad for p in parts], 1), x.grad, "dlogits")


# -- partials / merge API ---------------------------------------------------------------------------
def test_partials_shapes_and_target_ownership():
    logits, target, temp = _inputs(6, 1000)
    target[:] = torch.tensor([0, 124, 125, 500, 874, 999])
    m, s, z_t = logp_partials(logits[:, 125:500], target, temp, 125, 1000)  # groups 1, 2, 3
    assert m.shape == s.shape == (6, 3)
    owned = (target >= 125) & (target < 500)
    assert torch.isinf(z_t[~owned]).all() and (z_t[~owned] < 0).all()
    assert torch.isfinite(z_t[owned]).all()


# -- opcheck ----------------------------------------------------------------------------------------
def test_opcheck_token_logprobs():
    logits, target, temp = _inputs(5, 1000)
    torch.library.opcheck(torch.ops.rlk.token_logprobs.default,
                          ([logits.clone().requires_grad_()], target, temp))
    torch.library.opcheck(torch.ops.rlk.token_logprobs.default,
                          ([logits[:, :500], logits[:, 500:]], target, temp))


def test_opcheck_partials_and_merge():
    logits, target, temp = _inputs(5, 1000)
    torch.library.opcheck(torch.ops.rlk.logp_partials.default, (logits[:, 250:750], target, temp, 250, 1000))
    m, s, z_t = logp_partials(logits, target, temp, 0, 1000)
    torch.library.opcheck(torch.ops.rlk.merge_logp_partials.default, (m, s, z_t, 1000))


# -- bad inputs -------------------------------------------------------------------------------------
def _bad_cases():
    logits, target, temp = _inputs(4, 1000)
    return [
        ("target has values", (logits, torch.tensor([0, 1, 2, 1000]), temp)),
        ("target has values", (logits, torch.tensor([0, -1, 2, 3]), temp)),
        ("target must have shape", (logits, target[:3], temp)),
        ("target has dtype", (logits, target.float(), temp)),
        ("logits[0] has dtype", (logits.long(), target, temp)),
        ("logits[0] must have 2 dims", (logits[None], target, temp)),
        ("temperature must be finite and > 0", (logits, target, 0.0)),
        ("temperature must be finite and > 0", (logits, target, torch.tensor([1.0, -1.0, 1.0, 1.0]))),
        ("temperature must be a float, a 0-d tensor or shape", (logits, target, torch.ones(3))),
        ("the vocabulary is empty", (logits[:, :0], target.clamp(max=0), temp)),
        ("does not start and end on group boundaries", ([logits[:, :100], logits[:, 100:]], target, temp)),
        ("same rows", ([logits[:, :500], logits[:3, 500:]], target, temp)),
        ("logits[1] has dtype", ([logits[:, :500], logits[:, 500:].double()], target, temp)),
        ("dtypes must match", ([logits[:, :500], logits[:, 500:].half()], target, temp)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_rejects_bad_inputs(case):
    match, args = _bad_cases()[case]
    with pytest.raises(RlkInputError, match=re.escape(match)):
        token_logprobs(*args)


def test_rejects_bad_partials_and_merge():
    logits, target, temp = _inputs(4, 1000)
    with pytest.raises(RlkInputError, match="group boundaries"):
        logp_partials(logits[:, 100:500], target, temp, 100, 1000)
    m, s, z_t = logp_partials(logits[:, :500], target, temp, 0, 1000)
    with pytest.raises(RlkInputError, match="gather every shard's partials"):
        merge_logp_partials(m, s, z_t, 1000)


def test_rejects_device_mismatch():
    logits, target, temp = _inputs(4, 1000)
    with pytest.raises(RlkInputError, match="one device"):
        torch.ops.rlk.token_logprobs([logits], target.to("meta"), temp)


# -- negative control --------------------------------------------------------------------------------
def test_negative_control_naive_shard_merge():
    """Per-shard ``torch.logsumexp`` then a ``logsumexp`` of the shard results (the naive vocab-parallel
    merge) is not bitwise equal to the unsharded ``torch.logsumexp``; rlk's tree is (see above)."""
    logits, target, _ = _inputs(16, 4096 + 24)
    full = torch.logsumexp(logits, -1)
    differs = 0
    for n in (2, 4, 8):
        parts = torch.stack([torch.logsumexp(logits[:, a:e], -1) for a, e in shard_bounds(4096 + 24, n)], -1)
        differs += int((torch.logsumexp(parts, -1) != full).sum())
    assert differs > 0, "the naive merge happened to match on these inputs; pick others"
    ok, detail = check_vocab_shard_merge(logits, target, 1.0)
    assert ok, detail


def test_tree_structure_constants():
    # the structure is a function of V only
    assert L.group_bounds(QWEN3_VOCAB)[1] == 18992 and L.padded_blocks(QWEN3_VOCAB) == 128
    assert L.num_groups(9) == 5 and L.group_bounds(9) == [0, 2, 4, 6, 8, 9, 9, 9, 9]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(v=st.integers(1, 3000), t=st.integers(0, 5), seed=st.integers(0, 2**16),
       dtype=st.sampled_from((torch.float32, torch.bfloat16)), int32=st.booleans())
def test_property_any_vocab_size_shards_and_formula(v, t, seed, dtype, int32):
    logits, target, temp = _inputs(t, v, dtype, seed=seed)
    target = target.int() if int32 else target
    ok, detail = check_vocab_shard_merge(logits, target, temp)
    assert ok, detail
    logp, lse = token_logprobs(logits, target, temp)
    want_logp, want_lse = _formula64(logits, target.long(), temp)
    assert_close_to_formula(logp, want_logp, torch.float32, "logp")
    assert_close_to_formula(lse, want_lse, torch.float32, "lse")


# -- the rlk.triton log-prob kernels under the Triton interpreter (CPU; the bits are not the GPU's) --
_INTERPRET_SCRIPT = r'''
import torch
from rlk_core.ops import _logp_tree as L
from rlk_core.ops.linear import triton as LT
from rlk_core.ops.linear_logprobs import triton as LLT
from rlk_core.ops.linear_logprobs.reference import linear_logprobs_backward_reference, linear_logprobs_reference
from rlk_core.ops.token_logprobs import triton as TT
from rlk_core.ops.token_logprobs.reference import token_logprobs_backward_reference, token_logprobs_reference
from rlk_core.ops._plan import jit_plan

CPU = jit_plan(torch.device("cpu"))


def close(a, b, rtol, atol, what):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: what + ": " + m)

g = torch.Generator().manual_seed(0)
for t, v, dt in ((5, 1000, torch.float32), (3, 2051, torch.bfloat16), (2, 9, torch.float16)):
    x = (torch.randn(t, v, generator=g) * 4).to(dt)
    x[0, : v // 3] = float("-inf")
    y = torch.randint(0, v, (t,), generator=g)
    y[0] = v - 1
    temp = torch.rand(t, generator=g) + 0.5
    lp, lse = TT.forward(CPU, [x], y, temp)
    rl, rs = token_logprobs_reference([x], y, temp)
    close(lp, rl, 1e-5, 1e-5, "logp")
    close(lse, rs, 1e-5, 1e-5, "lse")
    b = L.group_bounds(v)
    for n in (2, 4, 8):
        per = 8 // n
        sh = [x[:, b[i * per]:b[(i + 1) * per]] for i in range(n)]
        a = TT.forward(CPU, sh, y, temp)
        assert torch.equal(a[0], lp) and torch.equal(a[1], lse), ("shards", n)
        parts = [TT.logp_partials(CPU, s_, y, temp, b[i * per], v) for i, s_ in enumerate(sh)]
        m, s = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
        zt = torch.stack([p[2] for p in parts]).amax(0)
        c = TT.merge_logp_partials(CPU, m, s, zt, v)
        assert torch.equal(c[0], lp) and torch.equal(c[1], lse), ("partials", n)
    for i in range(t):
        a = TT.forward(CPU, [x[i:i + 1]], y[i:i + 1], temp[i:i + 1])
        assert torch.equal(a[0], lp[i:i + 1]) and torch.equal(a[1], lse[i:i + 1]), ("row", i)
    gl, gs = torch.randn(t, generator=g), torch.randn(t, generator=g)
    d = TT.backward(CPU, [x], y, temp, lse, gl, gs)[0]
    r = token_logprobs_backward_reference([x], y, temp, lse, gl, gs)[0]
    close(d, r, 1.6e-2, 1e-5, "dlogits")

# linear_logprobs: the GEMM kernel does not run under the interpreter; a torch stand-in takes its place
LT.forward = lambda p, x, w, b: torch.ops.rlk.linear(x, w, b)  # rlk.reference on the CPU, as the unfused side's
LT.into = lambda p, x, w, b, out: out.copy_((x.double() @ w.double().t()).to(out.dtype))
LLT.CHUNK_BYTES = 5 * 4 * 512  # several chunks per group
for t, v, h, dt in ((5, 4000, 64, torch.float32), (3, 1030, 48, torch.bfloat16)):
    hid = torch.randn(t, h, generator=g).to(dt)
    w = (torch.randn(v, h, generator=g) * 3 * h ** -0.5).to(dt)
    y = torch.randint(0, v, (t,), generator=g)
    temp = torch.rand(t, generator=g) + 0.5
    lp, lse = LLT.forward(CPU, hid, [w], y, temp)
    un = TT.forward(CPU, [torch.ops.rlk.linear(hid, w, None)], y, temp)
    assert torch.equal(lp, un[0]) and torch.equal(lse, un[1]), "fused != unfused"
    rl, rs = linear_logprobs_reference(hid, [w], y, temp)
    close(lp, rl, 1e-5, 1e-5, "linear logp")
    b = L.group_bounds(v)
    parts = [LLT.linear_logp_partials(CPU, hid, w[b[2 * i]:b[2 * i + 2]], y, temp, b[2 * i], v) for i in range(4)]
    m, s = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
    zt = torch.stack([p[2] for p in parts]).amax(0)
    assert torch.equal(TT.merge_logp_partials(CPU, m, s, zt, v)[0], lp), "linear partials"
    gl, gs = torch.randn(t, generator=g), torch.randn(t, generator=g)
    dh, dws = LLT.backward(CPU, hid, [w], y, temp, lse, gl, gs)
    rh, rws = linear_logprobs_backward_reference(hid, [w], y, temp, lse, gl, gs)
    tol = 1e-5 if dt == torch.float32 else 3e-2
    close(dh, rh, tol, tol, "dhidden")
    close(dws[0], rws[0], tol, tol, "dW")
print("INTERPRETER OK")
'''


def test_triton_kernels_under_interpreter():
    """The rlk.triton log-prob kernels run under TRITON_INTERPRET=1 (a subprocess: the flag must be set
    before Triton is imported): within tolerance of the reference, and the GPU invariances (vocab
    shards, partials + merge, rows alone vs in the batch, fused == unfused) hold bit for bit there."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "INTERPRETER OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


_MERGE_TREE_SCRIPT = r'''
import numpy as np
import torch
from rlk_core.ops import _logp_tree as L
from rlk_core.ops.token_logprobs import triton as TT
from rlk_core.ops._plan import jit_plan

CPU = jit_plan(torch.device("cpu"))
# equal maxima in a row make every exp factor exp(0) = 1 exactly, so the merged s is a plain fp32 sum whose
# bits depend on the order of the adds: equal bits <=> the kernel's tree is _logp_tree's tree
g = torch.Generator().manual_seed(1)
t, groups, p = 37, 8, 128
m = torch.randn(t, 1, 1, generator=g).expand(t, groups, p).contiguous()
s = torch.rand(t, groups, p, generator=g) * torch.logspace(-3, 3, p)[torch.randperm(p, generator=g)]
m[:, :, 75:] = float("-inf")  # padded slots: identities
s[:, :, 75:] = 0.0
m[3], s[3] = float("-inf"), 0.0  # a row of identities only
gm, gs = TT.merge_blocks(CPU, m, s)
wm, ws = L.tree_merge_halves(m, s)
assert torch.equal(gm, wm) and torch.equal(gs, ws), "merge_blocks != the halves tree"
other = s.view(t, groups, p // 2, 2).sum(-1)  # adjacent pairs first: another tree (negative control)
assert not torch.equal(L.tree_merge_halves(m[..., ::2], other)[1], ws), "the control tree gave the same bits"
for k in (8, 5, 1):
    zt = torch.randn(t, generator=g)
    lp, lse = TT.merge_logp_partials(CPU, gm[:, :k], gs[:, :k], zt, 1000)
    mm, ss = L.tree_merge_groups(gm[:, :k], gs[:, :k])
    want = torch.from_numpy(mm.numpy() + np.log(ss.numpy()))  # the interpreter's tl.log is numpy's
    assert torch.equal(lse, want) and torch.equal(lp, zt - want), ("merge_logp_partials != the groups tree", k)
print("MERGE TREES OK")
'''


def test_merge_kernels_follow_the_contract_trees_under_interpreter():
    """``_merge_blocks_kernel`` / ``_merge_groups_kernel`` merge in exactly the trees of ``_logp_tree``
    (halves inside a group, adjacent pairs across the 8 groups; identities are no-ops): with equal maxima
    the merged sums are order-sensitive fp32 sums, equal bit for bit to the torch trees' (and a different
    tree is shown to give other bits)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _MERGE_TREE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "MERGE TREES OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
