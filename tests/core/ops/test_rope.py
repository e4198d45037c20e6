"""rope (rlk.rope.v1): tables in fp32 from rope_theta and absolute positions."""

import math

import pytest
import torch

import rlk_core.ops as ops
from rlk_core.errors import RlkInputError
from rlk_core.ops.rope.reference import sincos64
from rlk_core.testing import assert_bitwise_equal, assert_close_to_formula, check_batch_invariance, check_run_to_run


def _formula(x, pos, theta, rd):
    inv = torch.tensor([theta ** (-(2.0 * i) / rd) for i in range(rd // 2)], dtype=torch.float32)
    ang = (pos.float()[:, None] * inv[None]).double()[:, None, :]  # the fp32 angle of the contract
    x6 = x.double()
    x1, x2 = x6[..., : rd // 2], x6[..., rd // 2 : rd]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin(), x6[..., rd:]], -1)


def test_sincos64_is_accurate_to_float64_rounding():
    a = torch.cat([torch.linspace(-10, 10, 10001, dtype=torch.float64), torch.rand(10000, dtype=torch.float64) * 1e6])
    s, c = sincos64(a)
    assert float((s - a.sin()).abs().max()) < 1e-12 and float((c - a.cos()).abs().max()) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rd", [128, 64])
def test_matches_float64_formula(dtype, rd):
    x = torch.randn(37, 3, 128).to(dtype)
    pos = torch.randint(0, 40000, (37,))
    assert_close_to_formula(ops.rope(x, pos, 1e6, rd), _formula(x, pos, 1e6, rd))


def test_tables_depend_only_on_position_not_on_how_many_are_built():
    pos = torch.randint(0, 1 << 20, (3000,))
    cos, sin = ops.rope_cos_sin(pos, 128, 1e6)
    for i in (0, 1, 17, 2999):
        c1, s1 = ops.rope_cos_sin(pos[i : i + 1], 128, 1e6)
        assert_bitwise_equal(c1[0], cos[i])
        assert_bitwise_equal(s1[0], sin[i])
    assert cos.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_and_offset_invariant(dtype):
    x = torch.randn(64, 4, 64).to(dtype)
    pos = torch.randint(0, 8192, (64,))
    ok, detail = check_batch_invariance(lambda a, p: ops.rope(a, p, 1e6), (x, pos), batch_sizes=range(1, 65))
    assert ok, detail
    # a chunk that starts mid-sequence gives the rows of the full sequence
    full = ops.rope(x, torch.arange(64), 1e6)
    assert_bitwise_equal(ops.rope(x[40:], torch.arange(40, 64), 1e6), full[40:])


def test_non_contiguous_run_to_run_backward_and_opcheck():
    x = torch.randn(4, 16, 5).transpose(1, 2)  # [4, 5, 16], non-contiguous
    pos = torch.arange(4)
    assert_bitwise_equal(ops.rope(x, pos, 1e4), ops.rope(x.contiguous(), pos, 1e4))

    def fwd_bwd():
        xx = x.clone().requires_grad_()
        y = ops.rope(xx, pos, 1e4)
        (y * y.detach().flip(0)).sum().backward()
        return y, xx.grad

    ok, detail = check_run_to_run(fwd_bwd)
    assert ok, detail
    # rotation is orthogonal: the gradient of sum(y * g) is the inverse rotation of g
    g = torch.randn(4, 5, 16)
    xx = x.clone().requires_grad_()
    ops.rope(xx, pos, 1e4).backward(g)
    x6 = x.double().requires_grad_()
    _formula(x6, pos, 1e4, 16).backward(g.double())
    assert_close_to_formula(xx.grad, x6.grad)
    torch.library.opcheck(torch.ops.rlk.rope, (torch.randn(3, 2, 8, requires_grad=True), torch.arange(3), 1e4, 8))


@pytest.mark.parametrize("args, match", [
    (lambda: (torch.randn(3, 2, 8), torch.arange(4)), "positions has 4 entries"),
    (lambda: (torch.randn(3, 2, 8), torch.tensor([0, -1, 2])), "positions has values in \\[-1, 2\\]"),
    (lambda: (torch.randn(3, 2, 8), torch.arange(3.0)), "positions has dtype torch.float32"),
    (lambda: (torch.randn(3, 8), torch.arange(3)), "x must have 3 dims"),
    (lambda: (torch.randn(3, 2, 8), torch.arange(3), 1e4, 5), "rotary_dim must be even"),
    (lambda: (torch.randn(3, 2, 8), torch.arange(3), -1.0), "theta must be > 0"),
])
def test_bad_inputs(args, match):
    a = args()
    if len(a) == 2:
        a = (*a, 1e4)
    with pytest.raises(RlkInputError, match=match):
        ops.rope(*a)


def test_angle_rounding_is_the_fp32_product_of_frameworks():
    pos = torch.tensor([12345])
    cos, _ = ops.rope_cos_sin(pos, 128, 1e6)
    inv1 = torch.tensor(1e6 ** (-2.0 / 128), dtype=torch.float32)
    ang = (torch.tensor(12345.0) * inv1).double()
    assert cos[0, 1].item() == torch.tensor(math.cos(ang.item()), dtype=torch.float32).item()


def test_reserve_tables_checks_its_arguments_and_is_a_no_op_without_triton_on_cuda():
    from rlk_core.errors import RlkInputError
    from rlk_core.ops.rope import reserve_tables

    reserve_tables("cpu", 64, 1e6, 4096)  # the reference builds its tables per call
    with pytest.raises(RlkInputError, match="max_positions"):
        reserve_tables("cpu", 64, 1e6, 0)


def test_a_reserved_table_is_used_without_reading_the_positions():
    """With the table reserved (what the vLLM plugin does at model load), the Triton launcher takes it as it
    is: no host sync on the positions per call, and the same table object every time."""
    pytest.importorskip("triton")
    import importlib

    kernels = importlib.import_module("rlk_core.ops.rope.triton")
    dev = torch.device("cpu")  # the cache is keyed by device; no kernel is launched here
    assert kernels.reserved_tables(dev, 32, 777.0) is None
    kernels.reserve(dev, 32, 777.0, 5000)
    cos, sin = kernels.reserved_tables(dev, 32, 777.0)
    assert cos.shape == sin.shape == (8192, 16) and cos.dtype == torch.float32
    kernels.tables(dev, 32, 777.0, 100)  # a smaller later need keeps the reserved table
    assert kernels.reserved_tables(dev, 32, 777.0)[0] is cos
