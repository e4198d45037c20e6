"""Each private torch API listed in ``rlk_core._compat`` exists on this torch and behaves as rlk-core uses it.

CI runs this on the torch it installs (``scripts/dev-install.sh``'s RLK_TORCH); the GPU sitting runs it on the
machine's torch. A torch release that renames or changes one of them fails here by name, not as a wrong answer
somewhere inside an op call.
"""

from __future__ import annotations

import re

import pytest
import torch

from rlk_core import _compat as compat


def test_every_listed_name_is_exported_and_documented():
    doc_names = set(re.findall(r"^``(\w+)``", compat.__doc__, flags=re.M))
    doc_names |= set(re.findall(r"^``\w+`` / ``(\w+)``", compat.__doc__, flags=re.M))
    assert doc_names == set(compat.__all__)
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name


def test_mode_probes_see_modes_and_transforms():
    assert compat.torch_function_mode_enabled() is False
    assert compat.dispatch_mode_depth() == 0
    assert compat.functorch_transforms_active() is False

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert compat.torch_function_mode_enabled() is True

    from torch.utils._python_dispatch import TorchDispatchMode

    class DMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with DMode():
        assert compat.dispatch_mode_depth() == 1

    seen = []

    def f(x):
        seen.append((compat.functorch_transforms_active(), compat.functorch_wrapped(x)))
        return x * 2

    torch.func.vmap(f)(torch.ones(3, 2))
    assert seen == [(True, True)]
    assert compat.functorch_wrapped(torch.ones(2)) is False
    t = torch.ones(2)
    assert compat.unwrap_if_dead(t) is t


def test_tensor_kind_probes():
    t = torch.ones(2)
    assert compat.is_functional(t) is False
    assert compat.is_fake(t) is False
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(2)
    assert compat.is_fake(fake) is True
    functional = torch._to_functional_tensor(t)
    assert compat.is_functional(functional) is True


def test_stream_capturing_off_graph():
    if torch.cuda.is_available():
        assert compat.stream_capturing() is False
        return
    # a CPU build of torch has only a placeholder: why _dispatch asks it for CUDA calls only
    with pytest.raises(RuntimeError):
        compat.stream_capturing()


def test_version_and_grad_helpers():
    t = torch.ones(2)
    v = t._version
    compat.increment_version((t,))
    assert t._version == v + 1
    assert compat.any_requires_grad(t, torch.ones(2, requires_grad=True)) is True
    assert compat.any_requires_grad(t, 3) is False


def test_keysets_mask_autograd_keys_away():
    DK, KS = compat.DispatchKey, compat.DispatchKeySet
    ks = KS(DK.CPU).add(DK.AutogradCPU).add(DK.ADInplaceOrView)
    assert not (ks & compat.AFTER_AUTOGRAD).has(DK.AutogradCPU)
    assert (ks & compat.AFTER_AUTOGRAD).has(DK.ADInplaceOrView)
    assert not (ks & compat.AFTER_AD_INPLACE).has(DK.ADInplaceOrView)
    assert (ks & compat.AFTER_AD_INPLACE).has(DK.CPU)
    assert isinstance(KS(DK.CPU).raw_repr(), int)


def test_make_autograd_impl_runs_a_registered_backward():
    lib = torch.library.Library("rlk_compat_test", "FRAGMENT")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CompositeExplicitAutograd")
    overload = torch.ops.rlk_compat_test.double.default

    class Info:
        _backward_fn = staticmethod(lambda ctx, g: g * 2)
        _setup_context_fn = None

    try:
        impl = compat.make_autograd_impl(overload, Info())
    except (AttributeError, TypeError) as exc:  # the signature changed: say so, by name
        pytest.fail(f"torch._library.autograd.make_autograd_impl no longer takes (op, info): {exc}")
    x = torch.ones(3, requires_grad=True)
    y = impl(compat.DispatchKeySet(compat.DispatchKey.CPU), x)
    y.sum().backward()
    assert torch.equal(y.detach(), torch.full((3,), 2.0))
    assert torch.equal(x.grad, torch.full((3,), 2.0))
