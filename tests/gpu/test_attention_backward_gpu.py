"""``attention_varlen`` backward on the GPU (backend ``rlk.triton``, contract ``rlk.attention.v1``):
bitwise run to run, within tolerance of ``attention_varlen_backward_reference`` (packed awkward lengths,
GQA, bottom-right aligned causal, chunk continuation, zigzag ``q_positions``, non-causal), and autograd
through ``rlk_core.ops.attention_varlen`` reaching the Triton kernels.

Tolerance (:func:`assert_grad_close`): per gradient tensor, ``||out - ref|| <= rtol * ||ref||`` with
``rtol`` from ``dtype_tols``, plus an elementwise guard ``|out - ref| <= 4 * rtol * max|ref|`` so one
wrong row cannot hide in the norm. Elementwise relative tolerance is not meaningful here: an element of
``dk`` is a sum over hundreds of ``dS * q`` terms of both signs (``dS = P * (dP - Delta)`` cancels by
construction), so it can be arbitrarily close to 0 relative to its terms, and the kernel rounds ``P`` and
``dS`` to the input dtype before its MMAs as every flash backward does.
"""

from __future__ import annotations

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops.attention import attention_varlen
from rlk_core.ops.attention.reference import attention_varlen_backward_reference
from rlk_core.testing import check_run_to_run, dtype_tols
from rlk_core.testing.attention import cu_seqlens, zigzag_positions

from ._shapes import RLK_GPU, randn

pytestmark = pytest.mark.gpu


def attention_varlen_backward(*args, cfg=None):
    """The rlk.triton backward kernels, imported on first use (collecting this file needs no Triton)."""
    from rlk_core.ops._plan import jit_plan
    from rlk_core.ops.attention.triton_backward import attention_varlen_backward as kernels

    return kernels(jit_plan(args[0].device), *args, cfg)


def make_inputs(lq, lk, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    t, tk = sum(lq), sum(lk)
    q = randn((t, hq, d), dtype, 1.0, seed)
    k = randn((tk, hkv, d), dtype, 1.0, seed + 1)
    v = randn((tk, hkv, d), dtype, 1.0, seed + 2)
    do = randn((t, hq, d), dtype, 1.0, seed + 3)
    return do, q, k, v, cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")


def assert_grad_close(out, ref, dtype, name):
    rtol = dtype_tols(dtype)["rtol"]
    assert bool(torch.isfinite(out).all()), f"{name}: non-finite values"
    o, r = out.double(), ref.double()
    err = (o - r).norm()
    assert float(err) <= rtol * float(r.norm()) + 1e-12, (
        f"{name}: ||err|| / ||ref|| = {float(err / r.norm().clamp_min(1e-30)):.3g} > {rtol}")
    worst = float((o - r).abs().max())
    assert worst <= 4 * rtol * float(r.abs().max()) + 1e-12, (
        f"{name}: max |err| {worst:.3g} > 4 * {rtol} * max|ref| {float(r.abs().max()):.3g}")


def check_against_reference(lq, lk, hq, hkv, d, dtype, causal=True, q_positions=None, seed=0, ref_on_cpu=False,
                            split=None):
    do, q, k, v, cq, ck = make_inputs(lq, lk, hq, hkv, d, dtype, seed)
    scale = d ** -0.5
    cfg = None
    if split is not None:
        from rlk_core.ops.attention.triton_backward import config

        cfg = config(dtype, d)
        cfg["dkdv"]["SPLIT_G"] = split
    out = attention_varlen_backward(do, q, k, v, cq, ck, scale, causal, q_positions, cfg=cfg)
    args = (do, q, k, v, cq, ck, scale, causal, q_positions)
    if ref_on_cpu:  # under racecheck every GPU kernel is instrumented: keep the reference's off the GPU
        out = [o.cpu() for o in out]
        args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    ref = attention_varlen_backward_reference(*args)
    for name, a, b in zip(("dq", "dk", "dv"), out, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_grad_close(a, b, dtype, f"{name} lq={lq} lk={lk} heads={hq}/{hkv} d={d} {dtype} causal={causal}")


def zigzag(lk, cp_size, rank):
    return torch.cat([zigzag_positions(n, cp_size, rank) for n in lk]).to(device="cuda", dtype=torch.int32)


AWKWARD = [1, 19, 99, 200]


@pytest.mark.parametrize("hq,hkv,dtype", [(32, 8, torch.bfloat16), (16, 8, torch.float16), (4, 1, torch.bfloat16)])
def test_backward_matches_reference_packed(hq, hkv, dtype):
    check_against_reference(AWKWARD, AWKWARD, hq, hkv, 128, dtype)


@pytest.mark.parametrize("split", [False, True])
def test_backward_both_dkdv_schedules_match_reference(split):
    # dK/dV per KV head (looping over the group) or per query head + fixed-order group sum
    check_against_reference(AWKWARD, AWKWARD, 32, 8, 128, torch.bfloat16, seed=15, split=split)
    check_against_reference([19, 200], [100, 200], 8, 2, 128, torch.bfloat16, causal=False, seed=16, split=split)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_matches_reference_chunk_continuation(dtype):
    # Lq < Lk: a chunk continuing a cached prefix (bottom-right aligned), plus an empty chunk
    check_against_reference([1, 19, 0, 99, 64], [5, 100, 33, 200, 130], 4, 1, 128, dtype, seed=3)


@pytest.mark.parametrize("cp_size,rank", [(2, 0), (2, 1), (4, 3)])
def test_backward_matches_reference_zigzag(cp_size, rank):
    lk = [19, 200, 99]
    pos = zigzag(lk, cp_size, rank)
    lq = [len(zigzag_positions(n, cp_size, rank)) for n in lk]
    check_against_reference(lq, lk, 8, 2, 128, torch.bfloat16, q_positions=pos, seed=5)


def test_backward_matches_reference_arbitrary_positions():
    lk = [150, 77]
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.randperm(150, generator=g)[:40], torch.randperm(77, generator=g)[:77]])
    check_against_reference([40, 77], lk, 4, 2, 64, torch.float16, q_positions=pos.to("cuda"), seed=6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_matches_reference_non_causal(dtype):
    check_against_reference([19, 1, 99], [200, 1, 99], 4, 2, 64, dtype, causal=False, seed=7)


def test_backward_matches_reference_odd_head_dim():
    check_against_reference([1, 77, 130], [1, 77, 130], 4, 2, 96, torch.bfloat16, seed=8)


@pytest.mark.parametrize("causal,zig", [(True, False), (True, True), (False, False)])
def test_backward_run_to_run(causal, zig):
    lk = [1, 19, 99, 200, 1000, 2600]
    pos = zigzag(lk, 2, 1) if zig else None
    lq = [len(zigzag_positions(n, 2, 1)) for n in lk] if zig else lk
    do, q, k, v, cq, ck = make_inputs(lq, lk, 32, 8, 128, torch.bfloat16, seed=9)
    ok, detail = check_run_to_run(
        lambda: attention_varlen_backward(do, q, k, v, cq, ck, 128 ** -0.5, causal, pos), repeats=10)
    assert ok, detail


def test_backward_many_sequences_per_sequence_bits():
    """300 packed sequences (more than one step of the in-kernel schedule scan), some empty: each
    sequence's dq, dk, dv equal the backward of that sequence alone, bit for bit (every program works on
    one sequence's tiles, anchored at its start)."""
    g = torch.Generator().manual_seed(12)
    lens = [0 if i % 41 == 3 else n for i, n in enumerate(torch.randint(1, 70, (300,), generator=g).tolist())]
    do, q, k, v, cq, ck = make_inputs(lens, lens, 16, 8, 128, seed=40)
    dq, dk, dv = attention_varlen_backward(do, q, k, v, cq, ck, 128 ** -0.5, True, None)
    for i in (0, 3, 127, 128, 200, 299):
        a, b = int(cq[i]), int(cq[i + 1])
        one = cu_seqlens([b - a], "cuda")
        alone = attention_varlen_backward(do[a:b], q[a:b], k[a:b], v[a:b], one, one, 128 ** -0.5, True, None)
        for name, packed, single in zip(("dq", "dk", "dv"), (dq, dk, dv), alone, strict=True):
            assert torch.equal(packed[a:b], single), f"{name} of sequence {i} (L={b - a}) packed vs alone"


def test_triton_backward_is_selected():
    do, q, k, v, cq, ck = make_inputs([5, 70], [5, 70], 4, 2, 128)
    sel = REGISTRY.select("attention_varlen_backward", "cuda", (do, q, k, v, cq, ck, 0.1, True, None), strict=True)
    assert sel.backend.id in RLK_GPU and sel.fallback_reason is None


def test_autograd_reaches_triton_backward():
    do, q0, k0, v0, cq, ck = make_inputs([19, 99], [40, 99], 8, 2, 128, seed=11)
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    attention_varlen(q, k, v, cq, ck, 128 ** -0.5).backward(do)
    direct = attention_varlen_backward(do, q0, k0, v0, cq, ck, 128 ** -0.5, True, None)
    for name, a, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), direct, strict=True):
        assert torch.equal(a, b), f"{name} via autograd differs from the selected backward"


def sanitize_cases() -> None:
    """Every backward kernel once at small awkward shapes (for compute-sanitizer); raises on a wrong result."""
    for dtype in (torch.bfloat16, torch.float32):
        check_against_reference([1, 19, 70], [1, 40, 70], 4, 2, 64, dtype, seed=12, ref_on_cpu=True)
        check_against_reference([5, 7], [19, 70], 2, 1, 96, dtype, causal=False, seed=13, ref_on_cpu=True)
        lk = [19, 70]
        check_against_reference([len(zigzag_positions(n, 2, 0)) for n in lk], lk, 2, 2, 64, dtype,
                                q_positions=zigzag(lk, 2, 0), seed=14, ref_on_cpu=True)
    torch.cuda.synchronize()
