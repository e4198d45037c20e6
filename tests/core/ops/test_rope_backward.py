"""rope's backward and tables: the companion op ``rope_backward`` (registry, readback, forcing, autograd wiring),
its ``rlk.triton`` kernel under the Triton interpreter (bitwise the reference backward), and the cached tables
(reserved tables read without a host sync, retired tables kept alive, positions past a table give NaN)."""

from __future__ import annotations

import importlib

import pytest
import torch

import rlk_core.ops as ops
from rlk_core.ops.rope.reference import rope_backward_reference, rope_reference
from rlk_core.testing import dtype_tols

from ._backward_companion import (
    check_forced_with_the_main_op,
    check_registered,
    check_reported,
    check_suite_refuses_broken_backwards,
)


def _inputs(t=9, heads=3, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, d, generator=g).to(dtype)
    return x, torch.randint(0, 5000, (t,), generator=g), torch.randn(t, heads, d, generator=g).to(dtype)


def _fwd_bwd(x, pos, grad, rd=16, fn=ops.rope):
    xx = x.clone().requires_grad_()
    return torch.autograd.grad(fn(xx, pos, 1e4, rd), (xx,), grad)


def test_registered_reported_and_forced_with_rope(clean_registry, monkeypatch):
    check_registered(clean_registry, "rope")
    x, pos, grad = _inputs()
    check_reported("rope", "attention", lambda: _fwd_bwd(x, pos, grad))
    check_forced_with_the_main_op(clean_registry, monkeypatch, "rope", lambda: _fwd_bwd(x, pos, grad))


@pytest.mark.parametrize("path", ["function", "dispatcher"])
@pytest.mark.parametrize("dtype,rd", [(torch.float32, 16), (torch.bfloat16, 8)])
def test_autograd_is_the_backward_op_and_matches_autograd_through_the_reference(path, dtype, rd):
    x, pos, grad = _inputs(dtype=dtype)
    (dx,) = _fwd_bwd(x, pos, grad, rd, ops.rope if path == "function" else torch.ops.rlk.rope)
    assert torch.equal(dx, rope_backward_reference(grad, pos, 1e4, rd)) and dx.dtype == dtype
    assert torch.equal(dx[..., rd:], grad[..., rd:])  # dims past rotary_dim pass the gradient through
    (auto,) = _fwd_bwd(x, pos, grad, rd, lambda a, p, th, r: rope_reference(a, p, th, r))
    torch.testing.assert_close(dx.double(), auto.double(), **dtype_tols(dtype))


def test_only_the_positions_are_saved_for_backward():
    x, pos, _ = _inputs()
    y = ops.rope(x.clone().requires_grad_(), pos, 1e4)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 1 and torch.equal(saved[0], pos)


def test_opcheck():
    x, pos, grad = _inputs(t=3, heads=2, d=8)
    torch.library.opcheck(torch.ops.rlk.rope_backward, (grad, pos, 1e4, 8))


def test_a_grown_table_retires_the_old_one_alive():
    """A larger need (a later, longer reservation) replaces the cached table; the replaced tensors stay
    referenced (a CUDA graph captured on them keeps reading valid memory) with their contents unchanged."""
    pytest.importorskip("triton")
    kernels = importlib.import_module("rlk_core.ops.rope.triton")
    dev = torch.device("cpu")
    kernels.reserve(dev, 16, 4321.0, 100)
    cos, sin = kernels.reserved_tables(dev, 16, 4321.0)
    kept = cos.clone()
    kernels.reserve(dev, 16, 4321.0, 9000)  # a longer reservation (a trainer beside vLLM)
    grown = kernels.reserved_tables(dev, 16, 4321.0)
    assert grown[0].shape[0] == 16384 and grown[0] is not cos
    assert any(c is cos and s is sin for c, s in kernels._RETIRED)
    assert torch.equal(cos, kept) and torch.equal(grown[0][: cos.shape[0]], cos)  # same rows, same bits
    kernels.tables(dev, 16, 4321.0, 50)
    assert kernels.reserved_tables(dev, 16, 4321.0)[0] is grown[0]  # never shrinks


def test_triton_backward_and_tables_interpreted(run_interpreted):
    """The backward kernel equals the reference backward bit for bit (every dtype, up to the interpreter's
    bf16 rounding; rotary dim below the head dim, one token, non-contiguous gradient), run to run and token
    alone vs in the batch; another theta's table differs (negative control). It reads the cached table as it
    is (no host sync: sizing is refused here) and builds one where none is cached. A reserved table is read
    without touching the positions; a position past it gives NaN for that token only, forward and backward;
    RLK_VALUE_CHECKS=always raises."""
    run_interpreted("""
        from rlk_core.errors import RlkInputError
        from rlk_core.ops.rope import triton as K
        from rlk_core.ops.rope.reference import rope_backward_reference as ref, rope_reference

        gen = torch.Generator().manual_seed(0)
        cpu = torch.device("cpu")

        def randn(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=gen).to(dtype)

        def interpreted(want, dt):
            # the interpreter rounds fp32 to bf16 toward zero (the GPU's conversion rounds to nearest even, as
            # torch does): the bf16 expectation here is the reference's fp32 result truncated
            if dt != torch.bfloat16:
                return want.to(dt)
            return (want.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dt)

        theta = 1e6
        for t, nh, d, rd in [(1, 1, 8, 8), (5, 3, 128, 128), (7, 8, 128, 64), (3, 2, 96, 64)]:
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                g = randn(t, nh, d, dtype=dt)
                pos = torch.randint(0, 3000, (t,), generator=gen)
                dx = K.backward(CPU, g, pos, theta, rd)
                want = interpreted(ref(g.float(), pos, theta, rd), dt)
                assert dx.dtype == dt and torch.equal(dx, want), (t, nh, d, rd, dt)
                if dt != torch.float32:  # the fp32 math is the reference's: only the last rounding differs
                    assert torch.equal(ref(g, pos, theta, rd), ref(g.float(), pos, theta, rd).to(dt))
                assert torch.equal(K.backward(CPU, g, pos, theta, rd), dx)
                assert torch.equal(K.backward(CPU, g[-1:], pos[-1:], theta, rd)[0], dx[-1])
        control = interpreted(ref(g, pos, theta, rd), g.dtype)
        assert not torch.equal(K.backward(CPU, g, pos, 1e4, rd), control)  # control

        g = randn(3, 40, 64).transpose(0, 1)[:, ::2]  # [40, 2, 64], strided
        pos = torch.arange(40)
        assert torch.equal(K.backward(CPU, g, pos, theta, 64), ref(g, pos, theta, 64))

        # the backward reads the cached table as it is; without one it builds one
        real_tables = K.tables
        K.tables = lambda *a: (_ for _ in ()).throw(AssertionError("sized a table"))
        g, pos = randn(6, 2, 64), torch.randint(0, 3000, (6,), generator=gen)
        assert torch.equal(K.backward(CPU, g, pos, theta, 64), ref(g, pos, theta, 64))  # cached above
        try:
            K.backward(CPU, g, pos, 777.5, 32)
        except AssertionError:
            pass
        else:
            raise SystemExit("a backward without a cached table did not build one")
        K.tables = real_tables
        assert torch.equal(K.backward(CPU, g, pos, 777.5, 32), ref(g, pos, 777.5, 32))

        # a reserved table: read as it is; positions past it give NaN for their token only
        x = randn(5, 3, 16)
        K.reserve(cpu, 16, 555.0, 100)
        rows = K.reserved_tables(cpu, 16, 555.0)[0].shape[0]
        pos = torch.tensor([0, rows - 1, rows, 7, -1])
        K.tables = lambda *a: (_ for _ in ()).throw(AssertionError("sized a table"))
        os.environ["RLK_VALUE_CHECKS"] = "never"
        for fn, r in ((lambda *a: K.forward(CPU, *a), rope_reference), (lambda *a: K.backward(CPU, *a), ref)):
            out = fn(x, pos, 555.0, 16)
            inside = torch.tensor([True, True, False, True, False])
            assert torch.isnan(out[~inside]).all() and not torch.isnan(out[inside]).any()
            assert torch.equal(out[inside], r(x[inside], pos[inside], 555.0, 16))
        out = K.forward(CPU, x, pos.clamp(0, rows - 1), 555.0, 16)
        assert torch.equal(out, rope_reference(x, pos.clamp(0, rows - 1), 555.0, 16))
        os.environ["RLK_VALUE_CHECKS"] = "always"
        try:
            K.forward(CPU, x, pos.clamp(0, rows), 555.0, 16)
        except RlkInputError as exc:
            assert "past the reserved cos/sin table" in str(exc), exc
        else:
            raise SystemExit("a position past the reserved table passed RLK_VALUE_CHECKS=always")
        K.forward(CPU, x, pos.clamp(0, rows - 1), 555.0, 16)  # in range: no error
        # the pass-through dims of a token past the table are NaN too
        x = randn(2, 1, 24)
        out = K.launch(CPU, x, torch.tensor([3, 9]), *K.reserved_tables(cpu, 16, 555.0), 16)
        assert not torch.isnan(out[0]).any()
        out = K.launch(CPU, x, torch.tensor([3, 9]), *(t[:5] for t in K.reserved_tables(cpu, 16, 555.0)), 16)
        assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
        print("ok")
    """)


def test_the_contract_suite_refuses_broken_backwards():
    check_suite_refuses_broken_backwards("rope")
