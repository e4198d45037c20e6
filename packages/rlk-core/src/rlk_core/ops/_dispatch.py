"""One call path for every op: the public function -> :meth:`Op.__call__` -> the selected backend -> its plan.

Every public op is an operator of the PyTorch dispatcher (``torch.ops.rlk.<name>``: autograd, fake tensors,
``torch.compile``), registered by :func:`define` with ``torch.library.Library`` directly rather than through
``torch.library.custom_op``, whose per-call Python wrappers (an aliasing check and a dynamo guard around the kernel,
an autograd kernel that re-enters the dispatcher) cost ~10 us of host time per ``torch.ops`` call on the CPU — the
calls Inductor's generated code makes in every vLLM step that is not a CUDA-graph replay. What :func:`define`
registers for ``rlk::<name>``: the schema ``torch.library.infer_schema`` gives the op's check function (alias
annotations for ``mutates_args``), tagged ``pt2_compliant_tag``; checks-then-:meth:`Op.run` as the CPU and CUDA
kernel; the fake implementation (:meth:`Op.register_fake`, also the Meta kernel); for an op that mutates arguments,
an ADInplaceOrView kernel that bumps their version counters; and an Autograd kernel (:func:`_autograd_kernel`) that
runs ``torch``'s own custom-op autograd (the registered backward) when grad mode is on and an input requires grad,
and otherwise the kernel at once where nothing below autograd is left to run (plain CPU or CUDA tensors). Under
``torch.inference_mode`` (vLLM) the dispatcher skips the Autograd kernel altogether. The private torch APIs this
takes are listed in :mod:`rlk_core._compat`.

:meth:`Op.__call__` (what the public function calls) goes past the dispatcher when it has nothing to add — plain
tensors, no autograd needed, no tracing, no dispatch or function mode: first the fast path (one C++ call that repeats
a call ``rlk.cuda`` ran as one program: signature, readback count, launch; ``csrc/rlk_cuda.cpp``), then the checks,
the backend selection (:data:`rlk_core.backends.REGISTRY`), the readback count and the backend. Eager training
(an input requires grad, plain tensors) runs a ``torch.autograd.Function`` built from the same kernel, setup and
backward, applied through its C ``apply`` (the dispatcher's autograd wrapper cost ~180 us of host time per forward
on the H200 machine). The implementation, and therefore the backend and the bits, are the same on every path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlk_core import _compat as compat
from rlk_core import envs
from rlk_core.backends import REGISTRY
from rlk_core.ops import _cuda
from rlk_core.ops._checks import PLAIN
from rlk_core.ops._plan import first_tensor, jit_plan
from rlk_core.readback import _ACTIVE as _readback_scope
from rlk_core.readback import note_op_call, strict_now

_OPS: dict[str, Op] = {}
_LIB = torch.library.Library("rlk", "FRAGMENT")  # every op define() registers (kept alive with the module)
MISS = type("_Miss", (), {"__repr__": lambda self: "<rlk fast-path miss>", "__slots__": ()})()
_FAST: list[Any] = [None]  # rlk_core._C.fast where the fast path is on
# argument types with nothing for the dispatcher to see (not tensors, no tensors inside); the exact types
_SCALARS = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout})
_is_compiling = torch.compiler.is_dynamo_compiling  # Dynamo folds it to True while it traces; one frame at run time
_grad_enabled = torch._C.is_grad_enabled
_profiling = torch.autograd._profiler_enabled  # rlk-repro run --trace: DIRECT calls go through the dispatcher
DIRECT, AUTOGRAD, DISPATCHER = range(3)


def treat_as_plain(*types: type) -> None:
    """Let calls take tensors of these exact types past the dispatcher as they take plain ones — for ``Parameter``
    subclasses whose ``__torch_function__`` only passes calls through to torch (vLLM's weight parameters): the
    backend and bits are the same on either path, only the dispatcher's host time is saved. A type whose
    ``__torch_function__`` does anything else must not be registered."""
    for cls in types:
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            raise TypeError(f"treat_as_plain takes tensor types, got {cls!r}")
        PLAIN.add(cls)
    if _FAST[0] is not None:
        fast_path(True)  # the fast path's own list of plain types


def _how(args: tuple[Any, ...]) -> int:
    """:data:`DIRECT` (no autograd needed), :data:`AUTOGRAD` (eager autograd over plain tensors) or
    :data:`DISPATCHER`. Per argument a set lookup of its exact type first, ``isinstance`` only for the rest."""
    if _is_compiling() or compat.torch_function_mode_enabled() or compat.dispatch_mode_depth() > 0:
        return DISPATCHER
    grad = _grad_enabled()
    how = DIRECT
    for arg in args:
        cls = type(arg)
        if cls in PLAIN:
            if grad and arg.requires_grad:
                how = AUTOGRAD
        elif cls in _SCALARS:
            continue
        elif isinstance(arg, (list, tuple)):
            for t in arg:
                if isinstance(t, torch.Tensor) and (type(t) not in PLAIN or (grad and t.requires_grad)):
                    return DISPATCHER
        elif isinstance(arg, torch.Tensor):  # a subclass: fake, functional, DTensor ...
            return DISPATCHER
    return how


class Op:
    """The operator ``rlk::<name>``: its checks, its registration with the dispatcher, and the call path."""

    def __init__(self, name: str, check: Callable[..., Any], mutates_args: tuple[str, ...]) -> None:
        if name in _OPS:
            raise RuntimeError(f"rlk::{name} is defined twice")
        self.name, self.check, self.slot, self.mutates_args = name, check, len(_OPS), mutates_args
        self.qualname = f"rlk::{name}"
        self._backward_fn: Callable[..., Any] | None = None  # what torch's custom-op autograd reads
        self._setup_context_fn: Callable[..., Any] | None = None
        self.apply: Callable[..., Any] | None = None  # the C apply of its autograd.Function (eager training)
        self.function: type[torch.autograd.Function] | None = None
        schema = torch.library.infer_schema(check, mutates_args=mutates_args)
        _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        self.overload = getattr(torch.ops.rlk, name).default
        args = self.overload._schema.arguments
        self.mutated = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        self.arity = len(args)
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, self.kernel, key)
        if self.mutated:
            _LIB.impl(name, _version_bump_kernel(self.overload, self.mutated), "ADInplaceOrView", with_keyset=True)
        _LIB.impl(name, _autograd_kernel(self), "Autograd", with_keyset=True)
        _OPS[name] = self

    def __repr__(self) -> str:
        return f"<rlk op {self.qualname}>"

    def __call__(self, *args: Any) -> Any:
        """The op: the fast path, else past the dispatcher where it has nothing to add, else through it."""
        fast = _FAST[0]
        if fast is not None and not _is_compiling():
            out = fast(self.slot, *args)
            if out is not MISS:
                return out
        how = _how(args)
        if how == DIRECT:
            if _profiling():  # a profiler is on (run --trace): through the dispatcher, which records rlk::<op>
                return self.overload(*args)
            self.check(*args)
            return self.run(args)
        if how == AUTOGRAD and self.function is not None:
            if len(args) == self.arity and not compat.functorch_transforms_active():
                # Function.apply less the signature binding: unwrap_dead_wrappers, whose isinstance is type-in-PLAIN
                return self.apply(*[compat.unwrap_if_dead(a) if type(a) in PLAIN else a for a in args])
            return self.function.apply(*args)
        return self.overload(*args)

    def kernel(self, *args: Any) -> Any:
        """The CPU and CUDA kernel of ``rlk::<name>`` and the forward of its autograd.Function: the fast path (a
        call that needs autograd misses it in :meth:`__call__` and takes it here, grad mode off), else the checks
        and :meth:`run`."""
        fast = _FAST[0]
        if fast is not None:
            out = fast(self.slot, *args)
            if out is not MISS:
                return out
        self.check(*args)
        return self.run(args)

    def run(self, args: tuple) -> Any:
        """Select the backend, count the call in the readback scope, run it; store a call ``rlk.cuda`` ran as one
        program of exactly these arguments for the fast path."""
        device = first_tensor(args).device
        # strict mode is read only where a backend fails its qualification (select's slow path)
        selection = REGISTRY.select(self.name, device.type, args, strict_now)
        backend = selection.backend
        mode = "graph" if device.type == "cuda" and compat.stream_capturing() else "eager"
        note_op_call(self.name, backend.id, backend.contract_id, selection.fallback_reason, mode, None,
                     selection.route_reason)
        plan = backend.plan_fn  # rlk.triton: the op's launch plan on the device's JIT plan
        out = plan(jit_plan(device), *args) if plan is not None else backend.fn(*args)
        if _FAST[0] is not None and backend.id == _cuda.BACKEND_ID and selection.fallback_reason is None:
            _store_fast(self, backend, mode, args)
        return out

    def register_fake(self, fn: Callable[..., Any], /) -> Callable[..., Any]:
        """The fake implementation (shapes, dtypes, devices of the outputs; also the Meta kernel); a decorator."""
        torch.library.register_fake(self.qualname, fn, lib=_LIB, _stacklevel=2)
        return fn

    def register_autograd(self, backward: Callable[..., Any], /, *,
                          setup_context: Callable[..., None] | None = None) -> None:
        """The backward, as ``torch.library.custom_op``'s ``register_autograd``: ``setup_context(ctx, inputs,
        output)`` in the forward, ``backward(ctx, *grads)``; for ops whose tensor inputs are direct arguments also
        the ``torch.autograd.Function`` eager calls take (it does not track tensors inside lists)."""
        if self.mutated:
            raise RuntimeError(f"{self.qualname} mutates its arguments: no autograd formula can be registered for it")
        self._backward_fn, self._setup_context_fn = backward, setup_context
        params = inspect.signature(self.check).parameters.values()
        if setup_context is not None and not any("list" in str(p.annotation) for p in params):
            self.function = type(f"{self.name}_function", (torch.autograd.Function,), {
                "forward": staticmethod(self.kernel), "setup_context": staticmethod(setup_context),
                "backward": staticmethod(backward)})
            self.apply = super(torch.autograd.Function, self.function).apply


def define(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Op]:
    """Define ``rlk::<name>`` from its check function (annotated with the op's signature; it raises on bad
    input and returns nothing): ``@define("linear") def _linear(x: Tensor, ...) -> Tensor: <checks>``."""
    return lambda check: Op(name, check, tuple(mutates_args))


def op(name: str) -> Op:
    return _OPS[name]


# -- registration below autograd -------------------------------------------------------------------------------------
_DK = compat.DispatchKey
# what is left below autograd for plain CPU / CUDA tensors: the backend key, and ADInplaceOrView where the op has a
# kernel there (a mutating op; for the others the dispatcher drops that fallthrough key from the set)
_PLAIN_BELOW = frozenset(
    compat.DispatchKeySet(backend).add(extra).raw_repr() if extra is not None
    else compat.DispatchKeySet(backend).raw_repr()
    for backend in (_DK.CPU, _DK.CUDA) for extra in (_DK.ADInplaceOrView, None))
_BELOW_IS_PLAIN: dict[int, bool] = {}  # a call's whole dispatch key set (raw) -> nothing but a backend below autograd


def _below_is_plain(keyset: Any) -> bool:
    """Whether the dispatcher, entered below autograd with ``keyset``, would run nothing but the CPU or CUDA kernel:
    no Python key (dispatch mode, tensor subclass, fake tensor), no functionalization, no meta tensor, no
    conjugate/negative view, no functorch layer. Cached per key set."""
    raw = keyset.raw_repr()
    plain = _BELOW_IS_PLAIN.get(raw)
    if plain is None:
        plain = _BELOW_IS_PLAIN[raw] = (keyset & compat.AFTER_AUTOGRAD).raw_repr() in _PLAIN_BELOW
    return plain


def _version_bump_kernel(overload: Any, mutated: tuple[int, ...]) -> Callable[..., Any]:
    """ADInplaceOrView: the mutated arguments' version counters go up (autograd's in-place checks see the write),
    then the call goes on below (``torch.library.custom_op`` registers the same)."""
    def kernel(keyset: Any, *args: Any) -> Any:
        compat.increment_version(tuple(args[i] for i in mutated))
        return overload.redispatch(keyset & compat.AFTER_AD_INPLACE, *args)
    return kernel


def _autograd_kernel(op: Op) -> Callable[..., Any]:
    """The Autograd kernel of ``op``: ``torch``'s own custom-op autograd kernel where an input requires grad (what
    ``torch.library.custom_op`` registers: an ``autograd.Function`` whose forward runs the op below autograd and
    calls ``setup_context``); otherwise the kernel itself where nothing is left below autograd but the CPU or CUDA
    kernel (the mutated arguments' versions bumped as ADInplaceOrView would), else the dispatcher below autograd."""
    overload, mutated = op.overload, op.mutated
    with_grad = compat.make_autograd_impl(overload, op)

    def kernel(keyset: Any, *args: Any) -> Any:
        if _grad_enabled() and compat.any_requires_grad(*args):
            return with_grad(keyset, *args)
        plain = _BELOW_IS_PLAIN.get(keyset.raw_repr())  # _below_is_plain's cache, read without its frame
        if plain is None:
            plain = _below_is_plain(keyset)
        if plain:
            if mutated:
                compat.increment_version(tuple(args[i] for i in mutated))
            return op.kernel(*args)
        return overload.redispatch(keyset & compat.AFTER_AUTOGRAD, *args)
    return kernel


# -- the fast path ---------------------------------------------------------------------------------------------------
# Where rlk_core._C is loaded, a call that rlk.cuda ran as one program on exactly its arguments is stored in _C.fast
# per op (a slot) and call signature, with the readback record it counts into per scope; _C.fast(slot, *args) then
# runs a repeat of it in one C++ call and returns MISS for anything else (csrc/rlk_cuda.cpp says what). Same program,
# same launches, same bits; the readback counts the call as note_op_call counts a repeat. Whatever a selection or a
# decision depends on changing calls rlk_core.ops._plan.invalidate (the registry's backends, a held tensor replaced),
# which clears rlk.cuda's decisions and the fast path together. RLK_FAST_PATH=0 turns it off.
def fast_path(enabled: bool) -> bool:
    """Turn the fast path on or off (on by default where ``rlk_core._C`` is loaded: ``RLK_FAST_PATH``); returns
    whether it was on. Off, every call takes the Python path — the same backend and bits."""
    was = _FAST[0] is not None
    if enabled and _cuda._EXT:
        _cuda._EXT[0].fast_setup(_readback_scope, MISS, sorted(PLAIN, key=lambda c: c.__qualname__))
        _FAST[0] = _cuda._EXT[0].fast
    else:
        _FAST[0] = None
        if _cuda._EXT:
            _cuda._EXT[0].fast_clear()
    return was


def _store_fast(op: Op, backend: Any, mode: str, args: tuple) -> None:
    decided = _cuda.decided_program(op.name, args)
    if decided is None:
        return
    ext = _cuda._EXT[0]
    if ext.fast_store(op.slot, decided[0], *args):
        scope = _readback_scope.get()
        if scope is not None:
            record = scope.recorder.repeat_record(scope.module, op.name, backend.id, backend.contract_id, mode)
            if record is not None:
                ext.fast_count_into(scope, op.slot, mode == "graph", record)


_cuda._ON_LOAD.append(lambda ext: fast_path(envs.get("RLK_FAST_PATH")))
REGISTRY.on_change(_cuda.clear)
