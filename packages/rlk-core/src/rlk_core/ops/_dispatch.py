"""Backend choice inside an op: select from the registry, run, report to the readback scope.

Every public op is a ``torch.library`` custom op (``torch.ops.rlk.<name>``: autograd, fake tensors,
``torch.compile``). :func:`call` runs the op's implementation directly when the dispatcher has nothing
to add — plain tensors, no autograd needed, no tracing, no dispatch or function mode — which saves the
dispatcher's ~80 us of host time per call (a decode step makes hundreds of calls). When autograd is
needed but nothing else is (eager training), an op registered with :func:`register_autograd` runs as a
``torch.autograd.Function`` built from the same implementation, ``setup_context`` and backward: the
custom op's autograd wrapper cost ~180 us of host time per forward and ~150 us per backward on the H200
machine (``benchmarks/host_overhead.py``). The implementation, and therefore the backend and the bits,
are the same on every path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._C import _is_torch_function_mode_enabled as _torch_function_mode_enabled
from torch._C import _len_torch_dispatch_stack

from rlk_core.backends import REGISTRY
from rlk_core.readback import note_op_call, strict_now

_IMPLS: dict[str, Callable[..., Any]] = {}
_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}
_PACKETS: dict[str, Any] = {}
_PLAIN = {torch.Tensor, torch.nn.Parameter}  # tensor types the direct path takes; see treat_as_plain


def treat_as_plain(*types: type) -> None:
    """Let the direct path take tensors of these exact types as it takes plain ones — for ``Parameter``
    subclasses whose ``__torch_function__`` only passes calls through to torch (vLLM's weight parameters):
    the implementation, backend and bits are the same on either path, only the dispatcher's host time is
    saved. A type whose ``__torch_function__`` does anything else must not be registered."""
    for cls in types:
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            raise TypeError(f"treat_as_plain takes tensor types, got {cls!r}")
        _PLAIN.add(cls)


_DEVICE_TYPES: dict[torch.device, str] = {}  # torch.device.type builds a new string per call


def run(op: str, device: torch.device, *args: Any) -> Any:
    device_type = _DEVICE_TYPES.get(device)
    if device_type is None:
        device_type = _DEVICE_TYPES[device] = device.type
    # strict mode is read only where a backend fails its qualification (select's slow path)
    selection = REGISTRY.select(op, device_type, args, strict=strict_now)
    backend = selection.backend
    mode = "graph" if device_type == "cuda" and torch.cuda.is_current_stream_capturing() else "eager"
    note_op_call(op, backend.id, backend.contract_id, selection.fallback_reason, mode)
    return backend.fn(*args)


def custom_op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op("rlk::<name>")`` that also keeps the undecorated implementation for
    :func:`call`."""
    def wrap(fn: Callable[..., Any]) -> Any:
        _IMPLS[name] = fn
        return torch.library.custom_op(f"rlk::{name}", mutates_args=tuple(mutates_args))(fn)

    return wrap


def register_autograd(op: Any, backward: Callable[..., Any], setup_context: Callable[..., None]) -> None:
    """``op.register_autograd(backward, setup_context=...)`` for the dispatcher path, and the same pair as
    a ``torch.autograd.Function`` for eager calls through :func:`call`. Only for ops whose tensor inputs
    are direct arguments (``autograd.Function`` does not track tensors inside lists)."""
    op.register_autograd(backward, setup_context=setup_context)
    impl = _IMPLS[op._name]
    _FUNCTIONS[op._name] = type(f"{op._name}_function", (torch.autograd.Function,), {
        "forward": staticmethod(impl), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward)})


def _path(args: tuple[Any, ...]) -> str:
    """``"direct"`` (no autograd needed), ``"function"`` (eager autograd over plain tensors) or
    ``"dispatcher"``."""
    if (torch.compiler.is_compiling() or _torch_function_mode_enabled()
            or _len_torch_dispatch_stack() > 0):  # _python_dispatch._get_current_dispatch_mode() is not None
        return "dispatcher"
    grad = torch.is_grad_enabled()
    path = "direct"
    for arg in args:
        if type(arg) in _PLAIN:
            if grad and arg.requires_grad:
                path = "function"
        elif isinstance(arg, (list, tuple)):
            for t in arg:
                if isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or (grad and t.requires_grad)):
                    return "dispatcher"
        elif isinstance(arg, torch.Tensor):  # a subclass: fake, functional, DTensor ...
            return "dispatcher"
    return path


def call(name: str, *args: Any) -> Any:
    """``torch.ops.rlk.<name>(*args)``, or the same implementation without the dispatcher when nothing
    needs it (see the module docstring)."""
    path = _path(args)
    if path == "direct":
        return _IMPLS[name](*args)
    if path == "function" and name in _FUNCTIONS:
        return _FUNCTIONS[name].apply(*args)
    packet = _PACKETS.get(name)
    if packet is None:
        packet = _PACKETS[name] = getattr(torch.ops.rlk, name)
    return packet(*args)


def companion(make_backend: Callable[..., Any], op: str, fn: str, forward_args: Callable[..., tuple]) -> Any:
    """The backend of a companion op (a backward, a vocab-parallel half) from the forward's kernel module:
    ``make_backend(op, module=<forward's module>, fn=fn)``, accepting exactly what the forward's backend
    accepts — ``forward_args(*args)`` maps the companion's arguments to the forward's for ``supports``."""
    from rlk_core.contracts import COMPANION_OF

    backend = make_backend(op, module=f"rlk_core.ops.{COMPANION_OF[op]}.triton", fn=fn)
    forward_supports = backend.supports
    backend.supports = lambda *args: forward_supports(*forward_args(*args))
    return backend
