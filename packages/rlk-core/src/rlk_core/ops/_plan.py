"""Launch plans: each op's kernel launches written once.

An op's Triton module (``rlk_core/ops/<op>/triton.py``) writes its launcher as a *plan*: a function
``plan(p, *op_args)`` that allocates through ``p.new``, makes its descriptors with ``p.desc`` and launches with
``p.launch(kernel, grid, *args, **kwargs)`` exactly as ``kernel[grid](*args, **kwargs)`` would. The plan reads
the device's facts from ``p`` (``p.sms``, ``p.tma``), never from the device itself, so three things can run it:

- :class:`JitPlan` — backend ``rlk.triton``: every launch is Triton's JIT launch (this module);
- ``rlk.cuda`` (:mod:`rlk_core.ops._cuda`): the same launches resolved against the AOT manifest, kept per call
  signature as one program that ``rlk_core._C`` runs;
- the AOT build (:mod:`rlk_core.aot.build`): the launches of each op's build calls (``build_calls`` in its Triton
  module) on meta tensors, compiled ahead of time.

What a launch compiles to is decided once, here, by Triton's own binder (:func:`specialize`): the signature
types, the constexprs, which pointers are 16-byte aligned and which integers divisible by 16 or equal to 1 —
the JIT's specialisation of those very arguments. The AOT build compiles that specialisation; ``rlk.cuda``
serves a launch only with the variant of that key. So the cubin ``rlk.cuda`` launches is, by construction, the
binary Triton's JIT would compile for the launch (the same source, specialisation and options; the GPU suite
compares the bits and the Triton cache keys).

Importing this module imports neither Triton nor touches CUDA.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from rlk_core.backends import Backend

BACKEND_ID = "rlk.triton"
PRIORITY = 10
MIN_CAPABILITY = (8, 0)  # bf16 tensor-core dot; validated on sm_90 (H200)
INTERPRETER_SMS = 3  # the persistent kernels' program count on Triton's CPU interpreter (programs walk tiles)
FILLS = ("empty", "-inf", "zeros")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def available() -> tuple[bool, str]:
    """``(ok, reason)`` of ``rlk.triton``: Triton importable, a CUDA device of compute capability >= 8.0. ROCm
    builds of torch (``torch.version.hip``) are not validated, so the probe says no rather than guess."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return False, f"triton is not importable: {exc}"
    if getattr(torch.version, "hip", None):
        return False, "ROCm/HIP device: rlk.triton kernels are not validated on ROCm yet"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return False, f"compute capability {cap} < {MIN_CAPABILITY}"
    return True, f"triton on compute capability {cap}"


@functools.cache
def device_facts(device: torch.device) -> tuple[int, bool]:
    """``(SM count, TMA)`` of a device: a CUDA device's multiprocessors and whether it is NVIDIA sm_90+ (ROCm
    reports gfx9xx as capability 9.x and has no TMA); Triton's CPU interpreter: :data:`INTERPRETER_SMS`, no TMA."""
    if device.type != "cuda":
        return INTERPRETER_SMS, False
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, torch.version.hip is None and props.major >= 9


def first_tensor(args: tuple) -> torch.Tensor:
    """The first tensor of an op's arguments (a list of shards counts by its first element)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    raise TypeError("an op call without a tensor argument")


class Plan:
    """What a launch plan is written against (:class:`JitPlan` runs it; see the module docstring)."""

    sms: int  # the device's multiprocessor count: the persistent kernels' NUM_PROGRAMS
    tma: bool  # whether the device has the tensor memory accelerator (TMA descriptors)
    device: torch.device

    def new(self, shape: Any, dtype: torch.dtype, fill: str = "empty") -> torch.Tensor:
        """A buffer of the call: ``torch.empty`` / ``full(-inf)`` / ``zeros`` (``fill``) on the device."""
        raise NotImplementedError

    def contiguous(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x.to(dtype).contiguous()``: ``x`` itself where that is ``x``, else a copy."""
        raise NotImplementedError

    def reshape(self, x: torch.Tensor, *shape: int) -> torch.Tensor:
        """``x.reshape(*shape)``: a view where one exists, else a contiguous copy viewed so."""
        try:
            return x.view(*shape)
        except RuntimeError:
            return self.contiguous(x).view(*shape)

    def desc(self, t: torch.Tensor, block: list[int], shape: list[int] | None = None,
             strides: list[int] | None = None) -> Any:
        """A TMA descriptor with box ``block`` over the 2-D ``t`` (Triton's ``TensorDescriptor.from_tensor``), or over
        ``t``'s memory seen with ``shape`` and ``strides`` (a unit inner stride)."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        if shape is None:
            return TensorDescriptor.from_tensor(t, block)
        return TensorDescriptor(t, shape, strides, block)

    def launch(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """``kernel[grid](*args, **kwargs)``."""
        raise NotImplementedError

    def host(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Torch work between launches (an accumulation, a copy into an output): ``fn(*args, **kwargs)``."""
        raise NotImplementedError

    def free(self, *tensors: torch.Tensor) -> None:
        """Buffers the plan no longer reads (a chunk's logits): their memory may be reused."""


class JitPlan(Plan):
    """``rlk.triton``: a plan run on the device with Triton's JIT."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sms, self.tma = device_facts(device)

    def new(self, shape, dtype, fill="empty"):
        if fill == "-inf":
            return torch.full(shape, float("-inf"), dtype=dtype, device=self.device)
        if fill == "zeros":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def contiguous(self, x, dtype=None):
        return x.to(dtype or x.dtype).contiguous()

    def launch(self, kernel, grid, *args, **kwargs):
        kernel[grid](*args, **kwargs)

    def host(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


_JIT: dict[torch.device, JitPlan] = {}
_HELD: list[tuple[int, int, torch.Tensor]] = []  # (first byte, one past the last, tensor) of each held tensor
_INVALIDATE: list[Callable[[], None]] = []


def hold(*tensors: torch.Tensor) -> None:
    """Tensors an op keeps alive for good and never writes again (a reserved rope table, decode's offsets): a kept
    launch program (``rlk.cuda``) may bake their addresses in. Their owner calls :func:`invalidate` when it stops
    handing one out (a table replaced by a longer one; the old one stays alive)."""
    for t in tensors:
        start = t.data_ptr()
        _HELD.append((start, start + max(t.numel(), 1) * t.element_size(), t))


def is_held(address: int) -> bool:
    return any(start <= address < end for start, end, _ in _HELD)


def on_invalidate(fn: Callable[[], None]) -> None:
    _INVALIDATE.append(fn)


def invalidate() -> None:
    """Forget every kept decision and program (the one place: ``rlk.cuda``'s decisions, the fast path's calls)."""
    for fn in _INVALIDATE:
        fn()


def jit_plan(device: torch.device) -> JitPlan:
    p = _JIT.get(device)
    if p is None:
        p = _JIT[device] = JitPlan(device)
    return p


def resolve_fn(path: str) -> Callable[..., Any]:
    """``"module:function"`` -> the function (imports the module)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def triton_backend(op: str, plan: str, supports: str | None = None) -> Backend:
    """The ``rlk.triton`` :class:`Backend` of ``op``: ``plan`` (``"module:function"``, the op's launch plan) run by
    :class:`JitPlan`; ``supports`` (``"module:function"``) says per call whether the plan takes the arguments.
    Neither module is imported until a call needs it (importing it imports Triton)."""
    def run(*args: Any) -> Any:
        if backend.plan_fn is None:
            backend.plan_fn = resolve_fn(plan)
        return backend.plan_fn(jit_plan(first_tensor(args).device), *args)

    def says(*args: Any) -> tuple[bool, str]:
        backend.supports = resolve_fn(supports)
        return backend.supports(*args)

    backend = Backend(id=BACKEND_ID, op=op, fn=run, devices=("cuda",), priority=PRIORITY, available=available,
                      builtin=True, **({"supports": says} if supports else {}))
    backend.plan = plan
    return backend


# -- what a launch compiles to: Triton's own specialisation -------------------------------------------------
class Target:
    """A compile target: Triton's backend object for it (``make_backend``), its ``GPUTarget`` and a binder per kernel
    (Triton's ``create_function_from_signature``: what the JIT binds a launch's arguments with)."""

    def __init__(self, backend: str, arch: Any, warp_size: int) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self.gpu_target = GPUTarget(backend, arch, warp_size)
        self.backend = make_backend(self.gpu_target)
        self._binders: dict[Any, Callable[..., Any]] = {}

    def binder(self, kernel: Any) -> Callable[..., Any]:
        b = self._binders.get(kernel)
        if b is None:
            from triton.runtime.jit import create_function_from_signature

            b = self._binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        return b


def specialize(target: Target, kernel: Any, args: tuple, kwargs: dict[str, Any], generic: bool = False
               ) -> tuple[str, dict[str, Any], list[tuple[str, Any]], dict[str, Any]]:
    """What Triton's JIT (``JITFunction.run``) compiles for ``kernel[grid](*args, **kwargs)`` on ``target``:
    ``(key, bound arguments, specialisation, options)``. ``key`` names the variant — the kernel, the
    specialisation list (per argument its type and what the JIT assumes of it: constexpr values, 16-byte
    alignment, divisibility by 16) and the launch options, the JIT's ``debug`` and ``instrumentation_mode``
    included as it adds them — the same string on the build machine and on the GPU. ``generic``: the variant that
    assumes nothing of the runtime arguments (no alignment, no divisibility, no constant 1) — not a JIT binary."""
    from triton import knobs

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, spec, options = target.binder(kernel)(*args, **kwargs)
    if generic:
        from triton.runtime.jit import native_specialize_impl

        spec = [s if p.is_constexpr else native_specialize_impl(target.backend, v, p.is_const, False, False)
                for s, p, v in zip(spec, kernel.params, bound.values(), strict=True)]
        spec = [(ty, None) if ty != "constexpr" else (ty, a) for ty, a in spec]
    key = repr((f"{kernel.module}:{kernel.__name__}", tuple(spec), tuple(sorted(options.items()))))
    return key, bound, spec, options


def describe(spec: list[tuple[str, Any]]) -> str:
    """A specialisation in a line: ``[*bf16:D,i32,1,...]`` (a constexpr by its value, an attribute after a colon)."""
    parts = [repr(a) if ty == "constexpr" else ty + (f":{a}" if a else "") for ty, a in spec]
    text = "[" + ",".join(parts) + "]"
    return text if len(text) <= 240 else text[:237] + "...]"


def runtime_values(bound: dict[str, Any], spec: list[tuple[str, Any]]) -> list[tuple[str, str, Any]]:
    """The arguments a variant takes at launch, in the signature's order: ``(name, type, value)`` of every one the
    specialisation left a runtime argument (constexprs, and integers the JIT made constant 1, are in the binary)."""
    return [(name, ty, value) for (name, value), (ty, _) in zip(bound.items(), spec, strict=True)
            if ty != "constexpr"]
