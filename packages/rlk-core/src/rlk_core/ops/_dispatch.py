"""Backend choice inside an op: select from the registry, run, report to the readback scope.

Every public op is an operator of the PyTorch dispatcher (``torch.ops.rlk.<name>``: autograd, fake tensors,
``torch.compile``), registered by :func:`custom_op` with ``torch.library.Library`` directly rather than
through ``torch.library.custom_op``, whose per-call Python wrappers (an aliasing check and a dynamo guard
around the kernel, an autograd kernel that re-enters the dispatcher) cost ~10 us of host time per
``torch.ops`` call on the CPU — the calls Inductor's generated code makes in every vLLM step that is not a
CUDA-graph replay. :func:`call` runs the op's implementation directly when the dispatcher has nothing to
add — plain tensors, no autograd needed, no tracing, no dispatch or function mode — which saves the
dispatcher's host time per call (a decode step makes hundreds of calls). When autograd is needed but nothing
else is (eager training), an op registered with :func:`register_autograd` runs as a
``torch.autograd.Function`` built from the same implementation, ``setup_context`` and backward: the
dispatcher's autograd wrapper cost ~180 us of host time per forward and ~150 us per backward on the H200
machine (``benchmarks/host_overhead.py``); that Function is applied through its C ``apply`` (what
``Function.apply`` does after binding the arguments to the forward's signature with ``inspect.signature``,
the identity for positional arguments, and ~10-30 us of host time per forward on the CPU), the full
``Function.apply`` only under functorch transforms. The implementation, and therefore the backend and the
bits, are the same on every path.

What :func:`custom_op` registers for ``rlk::<name>`` (what ``torch.library.custom_op`` registered, less the
wrappers): the schema ``torch.library.infer_schema`` gives the implementation's signature (alias
annotations for ``mutates_args``), tagged ``pt2_compliant_tag``; the implementation as the CPU and CUDA
kernel; the fake implementation (:meth:`Op.register_fake`, also the Meta kernel); for an op that mutates
arguments, an ADInplaceOrView kernel that bumps their version counters; and an Autograd kernel
(:func:`_autograd_kernel`) that runs ``torch``'s own custom-op autograd (the registered backward, or an
error at backward where none is) when grad mode is on and an input requires grad, and otherwise runs the
implementation at once where nothing below autograd is left to run (plain CPU or CUDA tensors) — else it
re-enters the dispatcher below autograd (fake, functional, meta tensors; dispatch modes). Under
``torch.inference_mode`` (vLLM) the dispatcher skips the Autograd kernel altogether.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._C import _are_functorch_transforms_active as _functorch_transforms_active
from torch._C import _is_torch_function_mode_enabled as _torch_function_mode_enabled
from torch._C import _len_torch_dispatch_stack
from torch._C._functorch import unwrap_if_dead as _unwrap_if_dead
from torch._library.autograd import make_autograd_impl
from torch.cuda.graphs import _cuda_isCurrentStreamCapturing as _stream_capturing

from rlk_core import envs
from rlk_core.backends import REGISTRY
from rlk_core.ops import _cuda_common as _cc
from rlk_core.readback import _ACTIVE as _readback_scope
from rlk_core.readback import note_op_call, strict_now

_IMPLS: dict[str, Callable[..., Any]] = {}
_MUTATES: dict[str, tuple[str, ...]] = {}  # name -> the arguments its implementation writes (custom_op's)
_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}
_PACKETS: dict[str, Any] = {}
_PLAIN = {torch.Tensor, torch.nn.Parameter}  # tensor types the direct path takes; see treat_as_plain
_LIB = torch.library.Library("rlk", "FRAGMENT")  # every op custom_op defines (kept alive with the module)


def treat_as_plain(*types: type) -> None:
    """Let the direct path take tensors of these exact types as it takes plain ones — for ``Parameter``
    subclasses whose ``__torch_function__`` only passes calls through to torch (vLLM's weight parameters):
    the implementation, backend and bits are the same on either path, only the dispatcher's host time is
    saved. A type whose ``__torch_function__`` does anything else must not be registered."""
    for cls in types:
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            raise TypeError(f"treat_as_plain takes tensor types, got {cls!r}")
        _PLAIN.add(cls)
    if _FAST[0] is not None:
        fast_path(True)  # the fast path's own list of plain types


_DEVICE_TYPES: dict[torch.device, str] = {}  # torch.device.type builds a new string per call


def run(op: str, device: torch.device, *args: Any) -> Any:
    if _cc.catch is not None:
        _cc.catch.append(None)  # an op inside an rlk.cuda backend's call: that call is not one record
    fast = _FAST[0]
    if fast is not None:
        out = fast(_SLOTS.get(op, -1), *args)  # -1: an op registered without custom_op (never taught)
        if out is not _MISS:
            return out
    device_type = _DEVICE_TYPES.get(device)
    if device_type is None:
        device_type = _DEVICE_TYPES[device] = device.type
    # strict mode is read only where a backend fails its qualification (select's slow path)
    selection = REGISTRY.select(op, device_type, args, strict_now)
    backend = selection.backend
    # _stream_capturing: what torch.cuda.is_current_stream_capturing() returns, less its Python frame (a dummy
    # on a torch without CUDA, never called there)
    mode = "graph" if device_type == "cuda" and _stream_capturing() else "eager"
    note_op_call(op, backend.id, backend.contract_id, selection.fallback_reason, mode, None, selection.route_reason)
    if fast is None or backend.id != _cc.BACKEND_ID or selection.fallback_reason is not None:
        return backend.fn(*args)
    return _run_teaching(op, backend, mode, args)


# -- the fast path -----------------------------------------------------------------------------------------
# Where rlk_core._C is loaded (rlk.cuda), a call of an op that rlk.cuda served as one launch record on the op's own
# arguments is taught to _C.fast (rlk_core.ops._cuda_common.lesson): per op (a slot) and call signature, the record,
# where its inputs come from, and per readback scope the record the call counts into. _C.fast(slot, *args) then
# runs a repeat of that call in one C++ call — signature, readback count, output allocation, launch — and returns
# _MISS for anything it was not taught or that is not as when it was taught (csrc/rlk_cuda.cpp says what); the
# Python path then runs and teaches. Same record, same launch, same bits; the readback counts the call as
# note_op_call counts a repeat. What a selection or decision depends on changing calls fast_reset:
# the registry's set of backends, the record caches (rlk_core.ops._cuda_common.clear_records), a rope table
# replaced. RLK_FAST_PATH=0 turns it off.
_MISS = type("_Miss", (), {"__repr__": lambda self: "<rlk fast-path miss>", "__slots__": ()})()
_FAST: list[Any] = [None]  # _C.fast where the fast path is on
_SLOTS: dict[str, int] = {}  # op -> its slot in _C.fast
_CALL_SLOTS: dict[str, int] = {}  # the ops whose implementation is its checks, then run(op, device, *args)


def extension_loaded() -> None:
    """Set the fast path up on the extension just loaded (:func:`rlk_core.ops._cuda_common.extension`)."""
    fast_path(envs.get("RLK_FAST_PATH"))


def fast_path(enabled: bool) -> bool:
    """Turn the fast path on or off (on by default where ``rlk_core._C`` is loaded: ``RLK_FAST_PATH``); returns
    whether it was on. Off, every call takes the Python path — the same backend and bits (for benchmarks and
    tests that compare the two)."""
    was = _FAST[0] is not None
    ext = _cc._EXT  # rlk_core._C, once loaded
    if enabled and ext:
        ext[0].fast_init(_readback_scope, _MISS, sorted(_PLAIN, key=lambda c: c.__qualname__))
        _FAST[0] = ext[0].fast
    else:
        _FAST[0] = None
        fast_reset()
    return was


def fast_reset() -> None:
    """Forget what the fast path learnt (see above); a no-op before the extension is loaded."""
    if _cc._EXT:
        _cc._EXT[0].fast_reset()


REGISTRY.on_change(fast_reset)


def _run_teaching(op: str, backend: Any, mode: str, args: tuple) -> Any:
    """``backend.fn(*args)`` (rlk.cuda, no fallback), watching what it launches; teach ``_C.fast`` the call if it
    was one record on ``args``, and the readback record it counted into."""
    outer = _cc.catch
    seen: list = []
    _cc.catch = seen
    try:
        out = backend.fn(*args)
    finally:
        _cc.catch = outer  # (an outer backend call's catch already has this run()'s None)
    slot = _SLOTS.get(op, -1)
    lesson = _cc.lesson(args, out, seen) if slot >= 0 else None
    if lesson is not None:
        program, packed, mapping, extras, rebuild = lesson
        ext = _cc._EXT[0]
        ext.fast_teach(slot, program, packed, mapping, extras, rebuild, *args)
        scope = _readback_scope.get()
        if scope is not None:
            record = scope.recorder.repeat_record(scope.module, op, backend.id, backend.contract_id, mode)
            if record is not None:
                ext.fast_scope(scope, slot, mode == "graph", record)
    return out


# -- registration ---------------------------------------------------------------------------------------
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_AFTER_AD_INPLACE = torch._C._after_ADInplaceOrView_keyset
_DK = torch._C.DispatchKey
# what is left below autograd for plain CPU / CUDA tensors: the backend key, and ADInplaceOrView where the op
# has a kernel there (a mutating op; for the others the dispatcher drops that fallthrough key from the set)
_PLAIN_BELOW = frozenset(
    torch._C.DispatchKeySet(backend).add(extra).raw_repr() if extra is not None
    else torch._C.DispatchKeySet(backend).raw_repr()
    for backend in (_DK.CPU, _DK.CUDA) for extra in (_DK.ADInplaceOrView, None))
_BELOW_IS_PLAIN: dict[int, bool] = {}  # a call's whole dispatch key set (raw) -> nothing but a backend below autograd


def _below_is_plain(keyset: torch._C.DispatchKeySet) -> bool:
    """Whether the dispatcher, entered below autograd with ``keyset``, would run nothing but the CPU or CUDA
    kernel (ADInplaceOrView is a fallthrough for a functional op): no Python key (dispatch mode, tensor
    subclass, fake tensor), no functionalization, no meta tensor, no conjugate/negative view, no functorch
    layer. Cached per key set."""
    raw = keyset.raw_repr()
    plain = _BELOW_IS_PLAIN.get(raw)
    if plain is None:
        plain = _BELOW_IS_PLAIN[raw] = (keyset & _AFTER_AUTOGRAD).raw_repr() in _PLAIN_BELOW
    return plain


class Op:
    """The operator ``rlk::<name>`` that :func:`custom_op` registered; ``op(*args)`` calls it through the
    dispatcher. Holds what ``torch``'s custom-op autograd reads (``_backward_fn``, ``_setup_context_fn``)."""

    def __init__(self, name: str, fn: Callable[..., Any], mutates_args: tuple[str, ...]) -> None:
        self._name = name
        self._qualname = f"rlk::{name}"
        self._backward_fn: Callable[..., Any] | None = None
        self._setup_context_fn: Callable[..., Any] | None = None
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        self._opoverload = getattr(torch.ops.rlk, name).default
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, key)
        args = self._opoverload._schema.arguments
        self._mutated = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        if self._mutated:
            _LIB.impl(name, _version_bump_kernel(self._opoverload, self._mutated), "ADInplaceOrView",
                      with_keyset=True)
        _LIB.impl(name, _autograd_kernel(self, fn), "Autograd", with_keyset=True)

    def __repr__(self) -> str:
        return f"<rlk op {self._qualname}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._opoverload(*args, **kwargs)

    def register_fake(self, fn: Callable[..., Any], /) -> Callable[..., Any]:
        """The fake implementation (shapes, dtypes, devices of the outputs; also the Meta kernel); a decorator."""
        torch.library.register_fake(self._qualname, fn, lib=_LIB, _stacklevel=2)
        return fn

    def register_autograd(self, backward: Callable[..., Any], /, *,
                          setup_context: Callable[..., None] | None = None) -> None:
        """The backward of the dispatcher path, as ``torch.library.custom_op``'s ``register_autograd``:
        ``setup_context(ctx, inputs, output)`` in the forward, ``backward(ctx, *grads)``."""
        if self._mutated:
            raise RuntimeError(f"{self._qualname} mutates its arguments: no autograd formula can be registered "
                               "for it (make a functional op for that)")
        self._backward_fn, self._setup_context_fn = backward, setup_context


def _version_bump_kernel(overload: Any, mutated: tuple[int, ...]) -> Callable[..., Any]:
    """ADInplaceOrView: the mutated arguments' version counters go up (autograd's in-place checks see the
    write), then the call goes on below (``torch.library.custom_op`` registers the same)."""
    def kernel(keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        torch._C._increment_version(tuple(args[i] for i in mutated))
        return overload.redispatch(keyset & _AFTER_AD_INPLACE, *args)
    return kernel


def _autograd_kernel(op: Op, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The Autograd kernel of ``op`` (see the module docstring). Where an input requires grad it is
    ``torch``'s own custom-op autograd kernel (what ``torch.library.custom_op`` and
    ``torch.library.register_autograd`` register: an ``autograd.Function`` whose forward runs the op below
    autograd and calls ``setup_context``, tensor lists included); otherwise ``fn`` itself where nothing is left
    to run below autograd but the CPU or CUDA kernel, which is ``fn`` (with the mutated arguments' versions
    bumped as ADInplaceOrView would), else the dispatcher below autograd."""
    overload, mutated = op._opoverload, op._mutated
    with_grad = make_autograd_impl(overload, op)
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad
    increment_version = torch._C._increment_version

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        if grad_enabled() and any_requires_grad(*args):
            return with_grad(keyset, *args)
        plain = _BELOW_IS_PLAIN.get(keyset.raw_repr())  # _below_is_plain's cache, read without its frame
        if plain is None:
            plain = _below_is_plain(keyset)
        if plain:
            if mutated:
                increment_version(tuple(args[i] for i in mutated))
            return fn(*args)
        return overload.redispatch(keyset & _AFTER_AUTOGRAD, *args)
    return kernel


def custom_op(name: str, mutates_args: Iterable[str] = (), direct_run: bool = False
              ) -> Callable[[Callable[..., Any]], Op]:
    """Register ``fn`` as the operator ``rlk::<name>`` (see the module docstring) and keep it for :func:`call`;
    returns the :class:`Op` (``register_fake``, ``register_autograd``). ``direct_run``: ``fn`` is its argument
    checks (which depend on nothing but the call signature) and then ``return run(name, device, *its arguments)``
    — so :func:`call` may ask the fast path first, as :func:`run` does."""
    def wrap(fn: Callable[..., Any]) -> Op:
        _IMPLS[name] = fn
        _MUTATES[name] = tuple(mutates_args)
        _SLOTS[name] = len(_SLOTS)
        if direct_run:
            _CALL_SLOTS[name] = _SLOTS[name]
        return Op(name, fn, _MUTATES[name])

    return wrap


def register_autograd(op: Op, backward: Callable[..., Any], setup_context: Callable[..., None]) -> None:
    """``op.register_autograd(backward, setup_context=...)`` for the dispatcher path, and the same pair as
    a ``torch.autograd.Function`` for eager calls through :func:`call`. Only for ops whose tensor inputs
    are direct arguments (``autograd.Function`` does not track tensors inside lists)."""
    op.register_autograd(backward, setup_context=setup_context)
    impl = _IMPLS[op._name]
    function = _FUNCTIONS[op._name] = type(f"{op._name}_function", (torch.autograd.Function,), {
        "forward": staticmethod(impl), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward)})
    params = inspect.signature(impl).parameters.values()
    if all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params):
        _APPLY[op._name] = (super(torch.autograd.Function, function).apply, len(params))


# name -> (the C ``apply`` of its autograd.Function, the implementation's parameter count): what
# ``Function.apply`` runs after binding the arguments to the forward's signature (``inspect.signature`` on
# every call, ~10 us on the CPU), which for all of them passed positionally, none defaulted, is the identity
_APPLY: dict[str, tuple[Callable[..., Any], int]] = {}


# argument types with nothing for the dispatcher to see (not tensors, no tensors inside); the exact types,
# so that a subclass (of int, str ...) takes the isinstance tests below as before
_SCALARS = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout})
# Dynamo folds it to True (by identity) while it traces; at run time one Python frame, where is_compiling()
# is two and adds the compile-session / export flag, under which every tracer works through a dispatch
# mode or a tensor subclass — both send a call to the dispatcher below — and a plain call outside any tracer
# runs the same implementation on either path
_is_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch._C.is_grad_enabled


def _path(args: tuple[Any, ...]) -> str:
    """``"direct"`` (no autograd needed), ``"function"`` (eager autograd over plain tensors) or
    ``"dispatcher"``. Per argument a set lookup of its exact type first (plain tensor, scalar), the
    ``isinstance`` tests only for the rest; ``requires_grad`` read only in grad mode."""
    if (_is_compiling() or _torch_function_mode_enabled()
            or _len_torch_dispatch_stack() > 0):  # _python_dispatch._get_current_dispatch_mode() is not None
        return "dispatcher"
    grad = _grad_enabled()
    path = "direct"
    for arg in args:
        cls = type(arg)
        if cls in _PLAIN:
            if grad and arg.requires_grad:
                path = "function"
        elif cls in _SCALARS:
            continue
        elif isinstance(arg, (list, tuple)):
            for t in arg:
                if isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or (grad and t.requires_grad)):
                    return "dispatcher"
        elif isinstance(arg, torch.Tensor):  # a subclass: fake, functional, DTensor ...
            return "dispatcher"
    return path


def call(name: str, *args: Any) -> Any:
    """``torch.ops.rlk.<name>(*args)``, or the same implementation without the dispatcher when nothing
    needs it (see the module docstring); first the fast path, for an op registered ``direct_run``."""
    fast = _FAST[0]
    if fast is not None and not _is_compiling():
        slot = _CALL_SLOTS.get(name)
        if slot is not None:
            out = fast(slot, *args)
            if out is not _MISS:
                return out
    path = _path(args)
    if path == "direct":
        return _IMPLS[name](*args)
    if path == "function":
        fast = _APPLY.get(name)
        if fast is not None and len(args) == fast[1] and not _functorch_transforms_active():
            # Function.apply, less the signature binding: its unwrap_dead_wrappers (a generator over the
            # arguments), whose isinstance is type-in-_PLAIN here (_path sent any other tensor elsewhere)
            return fast[0](*[_unwrap_if_dead(a) if type(a) in _PLAIN else a for a in args])
        if name in _FUNCTIONS:
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
