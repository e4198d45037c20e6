"""Every private torch API rlk-core touches, in one place (``tests/core/test_compat.py`` checks each one on the torch
CI installs: that it exists and behaves as used here).

rlk's ops register with ``torch.library.Library`` directly rather than through ``torch.library.custom_op``, whose
per-call Python wrappers cost host time on every call that goes through the dispatcher (``rlk_core.ops._dispatch``
says how much and why); and a call with nothing for the dispatcher to do (plain tensors, no autograd, no tracer)
skips it. Telling those calls apart, and running ``torch``'s own custom-op autograd where it is needed, takes:

==========================================  ===================================================================
name here                                   torch
==========================================  ===================================================================
``functorch_transforms_active``             ``torch._C._are_functorch_transforms_active``
``torch_function_mode_enabled``             ``torch._C._is_torch_function_mode_enabled``
``dispatch_mode_depth``                     ``torch._C._len_torch_dispatch_stack``
``unwrap_if_dead``                          ``torch._C._functorch.unwrap_if_dead``
``functorch_wrapped``                       ``torch._C._functorch.is_functorch_wrapped_tensor``
``is_functional``                           ``torch._is_functional_tensor``
``is_fake``                                 ``torch._subclasses.fake_tensor.is_fake`` (imported on first use)
``make_autograd_impl``                      ``torch._library.autograd.make_autograd_impl``
``stream_capturing``                        ``torch.cuda.graphs._cuda_isCurrentStreamCapturing``
``AFTER_AUTOGRAD`` / ``AFTER_AD_INPLACE``   ``torch._C._after_autograd_keyset`` / ``_after_ADInplaceOrView_keyset``
``DispatchKey`` / ``DispatchKeySet``        ``torch._C.DispatchKey`` / ``torch._C.DispatchKeySet``
``increment_version``                       ``torch._C._increment_version``
``any_requires_grad``                       ``torch._C._any_requires_grad``
==========================================  ===================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C import _are_functorch_transforms_active as functorch_transforms_active
from torch._C import _is_torch_function_mode_enabled as torch_function_mode_enabled
from torch._C import _len_torch_dispatch_stack as dispatch_mode_depth
from torch._C._functorch import is_functorch_wrapped_tensor as functorch_wrapped
from torch._C._functorch import unwrap_if_dead
from torch._library.autograd import make_autograd_impl
from torch.cuda.graphs import _cuda_isCurrentStreamCapturing as stream_capturing

AFTER_AUTOGRAD = torch._C._after_autograd_keyset
AFTER_AD_INPLACE = torch._C._after_ADInplaceOrView_keyset
DispatchKey = torch._C.DispatchKey
DispatchKeySet = torch._C.DispatchKeySet
increment_version = torch._C._increment_version
any_requires_grad = torch._C._any_requires_grad
is_functional = torch._is_functional_tensor
_fake: list[Callable[[Any], bool]] = []


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (torch.compile tracing)."""
    if not _fake:
        from torch._subclasses.fake_tensor import is_fake as fn

        _fake.append(fn)
    return _fake[0](t)


__all__ = ["AFTER_AD_INPLACE", "AFTER_AUTOGRAD", "DispatchKey", "DispatchKeySet", "any_requires_grad",
           "dispatch_mode_depth", "functorch_transforms_active", "functorch_wrapped", "increment_version",
           "is_fake", "is_functional", "make_autograd_impl", "stream_capturing", "torch_function_mode_enabled",
           "unwrap_if_dead"]
