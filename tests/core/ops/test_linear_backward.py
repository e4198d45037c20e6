"""linear's backward (dx = dy W, dW = dy^T x, db = dy^T 1) on the CPU: within ``dtype_tols`` of the float64
products and of autograd through the reference, bitwise run to run, every ``needs_input_grad`` subset, leading
dims; each GEMM gets views of dy, x and W (no operand copy, no padding); and the stored-layout kernels' compiled
variant (Triton's own cache key of each launch) is one for every token count. The kernels themselves run under
the interpreter in test_linear_backward_interpret.py and on the GPU in tests/gpu/test_linear_gpu.py."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

import rlk_core.ops as ops
from rlk_core.ops.linear.reference import linear_reference
from rlk_core.testing import check_run_to_run, dtype_tols

linear_mod = importlib.import_module("rlk_core.ops.linear")  # the module (rlk_core.ops.linear is the function)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS = [1, 17, 64, 1000]


def _inputs(lead, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(*lead, n, generator=g).to(dtype)
    return x, w, b, dy


def _grads(x, w, b, dy, need=(True, True, True), fn=ops.linear):
    leaves = [None if t is None else t.detach().clone().requires_grad_(r) for t, r in zip((x, w, b), need,
                                                                                          strict=True)]
    out = fn(*leaves)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, dy))
    return [next(got) if t is not None and t.requires_grad else None for t in leaves]


def assert_close_sum(got, want64, absdot64, dtype, name):
    """``|got - want| <= atol + rtol * max(|want|, sum |products|)`` (``dtype_tols``): two summation orders of
    one sum differ by ~sqrt(terms) eps of its absolute sum, which near zero is far above ``rtol * |want|``."""
    tols = dtype_tols(dtype)
    allowed = tols["atol"] + tols["rtol"] * torch.maximum(want64.abs(), absdot64)
    err = (got.double() - want64).abs()
    assert got.dtype == dtype and got.shape == want64.shape, (name, got.dtype, got.shape)
    assert bool((err <= allowed).all()), f"{name}: worst error / allowed {float((err / allowed).max()):.3g}"


def _check_against_float64(x, w, b, dy, grads, need):
    n, k = w.shape
    g64, x64, w64 = dy.double().reshape(-1, n), x.double().reshape(-1, k), w.double()
    dx, dw, db = grads
    if need[0]:
        assert_close_sum(dx, (g64 @ w64).reshape(x.shape), (g64.abs() @ w64.abs()).reshape(x.shape), x.dtype, "dx")
    if need[1]:
        assert_close_sum(dw, g64.t() @ x64, g64.abs().t() @ x64.abs(), w.dtype, "dW")
    if need[2]:
        assert_close_sum(db, g64.sum(0), g64.abs().sum(0), b.dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_grads_match_float64_products(t, dtype):
    """N, K awkward (not multiples of any tile), bias."""
    x, w, b, dy = _inputs((t,), 37, 70, dtype, seed=t)
    _check_against_float64(x, w, b, dy, _grads(x, w, b, dy), (True, True, True))


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True),
                                  (True, True, False), (False, True, True), (True, False, True)])
def test_every_needs_input_grad_subset(need):
    x, w, b, dy = _inputs((19,), 24, 40, torch.bfloat16, seed=3)
    grads = _grads(x, w, b, dy, need)
    assert [g is not None for g in grads] == list(need)
    _check_against_float64(x, w, b, dy, grads, need)


@pytest.mark.parametrize("bias", [True, False])
def test_leading_dims_and_no_bias(bias):
    x, w, b, dy = _inputs((3, 7), 20, 33, torch.float32, seed=5)
    grads = _grads(x, w, b if bias else None, dy, (True, True, bias))
    assert grads[0].shape == (3, 7, 33) and grads[1].shape == (20, 33)
    _check_against_float64(x, w, b, dy, grads, (True, True, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_autograd_through_the_reference(dtype):
    """The op's analytical backward against autograd through ``linear_reference`` (its fixed-tree forward
    differentiated by torch): the same gradients within tolerance (fp64 is not an op dtype, so no
    ``torch.autograd.gradcheck`` of the op itself)."""
    x, w, b, dy = _inputs((2, 31), 45, 66, dtype, seed=7)
    got = _grads(x, w, b, dy)
    want = _grads(x, w, b, dy, fn=linear_reference)
    g64, x64, w64 = dy.double().reshape(-1, 45), x.double().reshape(-1, 66), w.double()
    absdots = [(g64.abs() @ w64.abs()).reshape(x.shape), g64.abs().t() @ x64.abs(), g64.abs().sum(0)]
    for name, a, r, absdot in zip(("dx", "dW", "db"), got, want, absdots, strict=True):
        # both are rounded to the dtype: allow one rounding of each on top of the sum's own error
        assert_close_sum(a, r.double(), absdot + r.double().abs(), dtype, f"{name} vs autograd(reference)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_bitwise_run_to_run(dtype):
    x, w, b, dy = _inputs((2, 45), 29, 50, dtype, seed=11)
    ok, detail = check_run_to_run(lambda: _grads(x, w, b, dy), repeats=4)
    assert ok, detail


def test_empty_token_batch():
    x, w, b, dy = _inputs((0,), 6, 5, torch.float32)
    dx, dw, db = _grads(x, w, b, dy)
    assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros(6, 5)) and torch.equal(db, torch.zeros(6))


def test_each_gemm_gets_views_of_its_operands_no_copies(monkeypatch):
    """The backward's three GEMMs read dy, x and W where they are stored: W as the [K, N] operand (W.t()),
    dy and x transposed (dW), dy transposed against a broadcast column of ones (db) — no copy, no padded
    operand, no allocation of the token count for the ones."""
    x, w, b, dy = _inputs((4, 9), 12, 20, torch.bfloat16)
    seen = []

    def spy(*args):
        seen.append(args)
        return real(*args)

    real = linear_mod._linear
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out = ops.linear(*leaves)
    monkeypatch.setattr(linear_mod, "_linear", spy)
    out.backward(dy)
    assert len(seen) == 3

    def storage(t):
        return t.untyped_storage().data_ptr()

    (g_dx, w_t, _), (g_t, x_t, _), (g_t2, ones, _) = seen
    xs, ws = leaves[0], leaves[1]
    assert storage(w_t) == storage(ws) and w_t.shape == (20, 12) and w_t.stride() == (1, 20)
    assert storage(x_t) == storage(xs) and x_t.shape == (20, 36) and x_t.stride() == (1, 20)
    assert storage(g_t) == storage(g_t2) == storage(g_dx) and g_t.stride() == (1, 12) and g_dx.stride() == (12, 1)
    assert ones.shape == (1, 36) and ones.stride() == (1, 0) and ones.untyped_storage().nbytes() == 2
    from rlk_core.ops.linear.triton import stored_layout  # pure Python: no launch

    assert all(stored_layout(a, w_, None) for a, w_, _ in seen)  # on rlk.triton: the stored-layout kernels


# -- the compiled variants do not depend on the token count --------------------------------------------------------
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.seen.append((self.kernel, args, kwargs))


def _cache_keys(launches):
    """Triton's JIT cache key of each launch for sm_90 — the specialisation of every argument (types,
    16-divisibility, ones, descriptor boxes), the constexprs and the options — as ``JITFunction.run`` computes it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys = []
    for kernel, args, kwargs in launches:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        _, specialization, options = binder(*args, **kwargs)
        keys.append((kernel.fn.__name__, compute_cache_key({}, specialization, options)))
    return keys


@pytest.fixture
def triton_on_cpu():
    """``rlk.triton``'s linear (its launcher, not a GPU) registered as the preferred CPU backend of ``linear``
    for the test, so that the op's own backward reaches it with the views it passes."""
    from rlk_core.backends import REGISTRY, Backend
    from rlk_core.ops._plan import jit_plan
    from rlk_core.ops.linear import triton as lt

    REGISTRY.register(Backend("test.triton-on-cpu", "linear", lambda *a: lt.forward(jit_plan(a[0].device), *a),
                              devices=("cpu",), priority=50, builtin=True))
    yield lt
    REGISTRY.unregister("linear", "test.triton-on-cpu")


def _record_launches(monkeypatch, lt, tma):
    """Every GEMM kernel of ``rlk.triton`` replaced by a recorder (its launches land in the returned list), the
    device said to have TMA or not."""
    seen = []
    for name in ("_linear_bwd_tma_kernel", "_linear_bwd_kernel", "_linear_tma_kernel", "_linear_fwd_kernel"):
        monkeypatch.setattr(lt, name, _Recorder(getattr(lt, name), seen))
    from rlk_core.ops._plan import jit_plan

    monkeypatch.setattr(jit_plan(torch.device("cpu")), "tma", tma)
    return seen


@needs_triton
@pytest.mark.parametrize("dtype,tma", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
def test_compiled_variants_do_not_depend_on_the_token_count(monkeypatch, triton_on_cpu, dtype, tma):
    """The op's backward launches the same three compiled variants (kernel + Triton cache key) for dx, dW and
    db at every token count: T is the rows of dx and the reduction of dW and db, and neither the tile rule nor
    any argument specialisation reads it (``do_not_specialize`` M, K; no EVEN_K; the TMA kernel's
    NUM_PROGRAMS is the SM count; db's ones of stride 0 also at T = 1)."""
    seen = _record_launches(monkeypatch, triton_on_cpu, tma)
    per_t = {}
    for t in (1, 16, 17, 64, 1000, 1017, 4096):
        x, w, b, dy = _inputs((t,), 48, 40, dtype, seed=t)  # rows of 96 / 80 bytes: TMA-compatible in bf16
        leaves = [u.requires_grad_() for u in (x, w, b)]
        out = ops.linear(*leaves)  # recorded, not computed: the backward's launches are what is looked at
        del seen[:]
        out.backward(dy)
        per_t[t] = _cache_keys(seen)
    first = per_t[1]
    want = ["_linear_bwd_tma_kernel"] * 2 if tma else ["_linear_bwd_kernel"] * 2
    assert [name for name, _ in first] == [*want, "_linear_bwd_kernel"]  # dx, dW, db
    assert len(set(first)) == 3
    for t, keys in per_t.items():
        assert keys == first, f"T={t}: a compiled variant differs from T=1's"


@needs_triton
def test_cache_key_check_sees_the_old_token_reduction_negative_control(monkeypatch, triton_on_cpu):
    """The check above can fail: dW by the forward's kernel on contiguous transposed operands (the layout
    before the padding, whose K is the token count) compiles a new variant as T's divisibility changes."""
    lt = triton_on_cpu
    seen = _record_launches(monkeypatch, lt, False)
    for t in (64, 1000, 1024):  # K divisible by 16 / not / and by the 128-wide K block (EVEN_K)
        g, x = torch.randn(t, 48).bfloat16(), torch.randn(t, 40).bfloat16()
        lt.linear_2d(g.t().contiguous(), x.t().contiguous(), None)
    assert len(set(_cache_keys(seen))) == 3
