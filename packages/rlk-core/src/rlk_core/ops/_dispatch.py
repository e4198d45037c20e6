"""Backend choice inside an op: select from the registry, run, report to the readback scope.

Every public op is a ``torch.library`` custom op (``torch.ops.rlk.<name>``: autograd, fake tensors,
``torch.compile``). :func:`call` runs the op's implementation directly when the dispatcher has nothing
to add — plain tensors, no autograd needed, no tracing, no dispatch or function mode — which saves the
dispatcher's ~80 us of host time per call (a decode step makes hundreds of calls); the implementation,
and therefore the backend and the bits, are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import _python_dispatch

from rlk_core.backends import REGISTRY
from rlk_core.readback import note_op_call, strict_now

_IMPLS: dict[str, Callable[..., Any]] = {}
_PACKETS: dict[str, Any] = {}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def run(op: str, device: torch.device, *args: Any) -> Any:
    selection = REGISTRY.select(op, device.type, args, strict=strict_now())
    backend = selection.backend
    mode = "graph" if device.type == "cuda" and torch.cuda.is_current_stream_capturing() else "eager"
    note_op_call(op, backend.id, backend.contract_id, selection.fallback_reason, mode)
    return backend.fn(*args)


def custom_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op("rlk::<name>")`` that also keeps the undecorated implementation for
    :func:`call`."""
    def wrap(fn: Callable[..., Any]) -> Any:
        _IMPLS[name] = fn
        return torch.library.custom_op(f"rlk::{name}", mutates_args=tuple(mutates_args))(fn)

    return wrap


def _direct(args: tuple[Any, ...]) -> bool:
    if (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or _python_dispatch._get_current_dispatch_mode() is not None):
        return False
    grad = torch.is_grad_enabled()
    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or (grad and t.requires_grad)):
                return False
    return True


def call(name: str, *args: Any) -> Any:
    """``torch.ops.rlk.<name>(*args)``, or its implementation directly when nothing needs the dispatcher."""
    if _direct(args):
        return _IMPLS[name](*args)
    packet = _PACKETS.get(name)
    if packet is None:
        packet = _PACKETS[name] = getattr(torch.ops.rlk, name)
    return packet(*args)
