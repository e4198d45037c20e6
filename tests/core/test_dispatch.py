"""Public ops skip the PyTorch dispatcher only when it has nothing to add; same implementation, same bits,
same readback either way."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from rlk_core import ops
from rlk_core.ops import _dispatch as D
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.testing import assert_bitwise_equal


class _Spy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_direct_only_when_the_dispatcher_has_nothing_to_add():
    x = torch.randn(3, 8)
    assert D._direct((x, [x], None, 1.0))
    leaf = x.clone().requires_grad_()
    assert not D._direct((leaf,))
    with torch.no_grad():
        assert D._direct((leaf,))
    assert D._direct((torch.nn.Parameter(x, requires_grad=False),))
    with _Spy():
        assert not D._direct((x,))
    with FakeTensorMode() as mode:
        assert not D._direct((mode.from_tensor(x),))


def test_direct_and_dispatched_calls_agree_and_are_recorded():
    x, w = torch.randn(5, 64), torch.randn(24, 64)
    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"))
    with torch.no_grad(), rec.scope("ffn"):
        direct = ops.swiglu(ops.linear(x, w))
    dispatched = torch.ops.rlk.swiglu(torch.ops.rlk.linear(x, w, None))
    assert_bitwise_equal(direct, dispatched)
    ffn = rec.to_dict()["modules"]["ffn"]
    assert ffn["ops"]["linear"]["call_count"] == 1 and ffn["ops"]["swiglu"]["call_count"] == 1


def test_autograd_and_dispatch_modes_still_see_the_custom_op():
    x = torch.randn(4, 16, requires_grad=True)
    y = ops.swiglu(x)
    assert y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    spy = _Spy()
    with torch.no_grad(), spy:
        ops.swiglu(torch.randn(2, 16))
    assert any("rlk.swiglu" in name for name in spy.ops), spy.ops[:5]


def test_helper_ops_use_gpu_kernels_only_where_the_forward_selects_them():
    from rlk_core.ops._triton_common import kernels_if_selected

    logits, target, temp = torch.randn(2, 16), torch.tensor([1, 3]), torch.ones(2)
    assert kernels_if_selected("token_logprobs", logits.device, ([logits], target, temp)) is None
