"""Backend ``rlk.cuda``: each op's launch plan (:mod:`rlk_core.ops._plan`) served by the AOT cubins of
:mod:`rlk_core.aot`, launched by ``rlk_core._C`` (``csrc/rlk_cuda.cpp``).

A call is decided once per call signature (every tensor's shape, strides, dtype, device and address modulo 16;
the scalars): the op's plan runs on the call's own tensors with fresh, unfilled buffers and no launch, and each
launch it makes is specialised by Triton's binder as the JIT would (:func:`~rlk_core.ops._plan.specialize`) and
looked up in the manifest under that key. A launch no variant is — a head size, layout or integer class not built,
another SM count — declines the whole call (``supports``) and ``rlk.triton`` runs it: the same binaries compiled by
its JIT, so that is no fallback (``same_bits_as``). Where every pointer of every launch is an input of the call
(at a byte offset), a buffer the plan allocated, or a tensor held for good (:func:`~rlk_core.ops._plan.hold`), the
decision keeps the launches as one **program**: the buffers to allocate and the launches with their arguments as
data, which ``_C.run_program`` runs in one C++ call; a repeat of a call is then one dict lookup and one C++ call,
or none in Python at all on the fast path (:mod:`rlk_core.ops._dispatch`). A plan that copies an input, works on
the host between launches or frees a buffer runs from Python instead, each launch by ``_C.launch`` (the same
launches). Only aligned variants are built; for the kernels in :data:`GENERIC_BITWISE` (elementwise, no
reduction: their bits cannot depend on vector width, checked on the GPU) a launch whose exact variant is missing
takes the variant that assumes no alignment.

Importing this module imports neither Triton nor the extension.
"""

from __future__ import annotations

import functools
import json
import struct
import threading
from array import array
from pathlib import Path
from typing import Any

import torch

from rlk_core import envs
from rlk_core.backends import Backend
from rlk_core.ops import _plan
from rlk_core.ops._checks import _is_fake
from rlk_core.ops._plan import Plan, first_tensor, resolve_fn
from rlk_validate.evidence import SAME_BITS_AS

BACKEND_ID = "rlk.cuda"
PRIORITY = 20  # above rlk.triton (10): preferred where it can serve
TARGETS = {(9, 0): "cuda:90"}  # device capability -> the AOT target whose cubins run there
GENERIC_BITWISE = frozenset({"_swiglu_fwd_kernel", "_rope_fwd_kernel"})
MAX_DECISIONS = 16384  # past it the cache starts over (shapes of a long run with varying batch sizes)
SCALAR_TYPES = {torch.int32: 3, torch.int64: 4, torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}
# a program argument: (kind, six values) — csrc/rlk_cuda.cpp's ArgKind
IN, BUF, ADDR, INT, FLOAT, DESC = 0, 1, 2, 4, 5, 6
RET_ONE, RET_TUPLE, RET_NONE = 0, 1, 2  # what a program returns: its first buffer, all of them, nothing
_LOCK = threading.Lock()
_EXT: list[Any] = []  # rlk_core._C, once imported


# -- the manifest -------------------------------------------------------------------------------------------------
def aot_dir(target: str) -> Path:
    """Where the manifest and cubins of ``target`` are: ``$RLK_AOT_DIR`` or the installed package data."""
    override = envs.get("RLK_AOT_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "_aot" / target.replace(":", "_")


@functools.cache
def manifest(target: str) -> tuple[Path, dict[str, Any], dict[str, dict[str, Any]]]:
    """``(folder, manifest, variants by key)`` of ``target``."""
    folder = aot_dir(target)
    doc = json.loads((folder / "manifest.json").read_text())
    if doc.get("target") != target:
        raise RuntimeError(f"{folder}/manifest.json is for {doc.get('target')}, not {target}")
    return folder, doc, {e["key"]: e for e in doc["kernels"]}


@functools.cache
def device_target(index: int) -> _plan.Target | None:
    """The compile target of a CUDA device whose capability has AOT cubins, or None."""
    name = TARGETS.get(torch.cuda.get_device_capability(index))
    if name is None:
        return None
    target = _plan.Target("cuda", torch.cuda.get_device_capability(index)[0] * 10, 32)
    target.name = name
    return target


def extension() -> Any:
    """``rlk_core._C`` (imported once; the fast path set up on it: :func:`rlk_core.ops._dispatch.fast_path`)."""
    if not _EXT:
        from rlk_core import _C

        _EXT.append(_C)
        for fn in _ON_LOAD:
            fn(_C)
    return _EXT[0]


_ON_LOAD: list[Any] = []  # called with the extension once it is imported (the dispatcher's fast path)


def available() -> tuple[bool, str]:
    """``(ok, reason)``: ``rlk_core._C`` importable, a CUDA device whose capability has an AOT target, that target's
    manifest present and built by the installed Triton (a cubin of other kernel sources would not be rlk.triton's)."""
    if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        extension()
    except ImportError as exc:
        return False, f"rlk_core._C is not built ({exc}); install rlk-core with a CUDA toolchain"
    cap = torch.cuda.get_device_capability()
    target = TARGETS.get(cap)
    if target is None:
        return False, f"no AOT target for compute capability {cap} (built: {sorted(TARGETS.values())})"
    folder = aot_dir(target)
    if not (folder / "manifest.json").is_file():
        return False, f"no AOT manifest at {folder} (set RLK_AOT_DIR or install with RLK_BUILD_TARGETS)"
    try:
        import triton

        _, doc, variants = manifest(target)
        if doc["triton_version"] != triton.__version__:
            return False, (f"cubins built by Triton {doc['triton_version']}, rlk.triton runs {triton.__version__}: "
                           "not the same binaries")
    except Exception as exc:  # a broken manifest is an unavailable backend, with the reason
        return False, f"AOT manifest at {folder}: {type(exc).__name__}: {exc}"
    return True, f"{len(variants)} AOT variants for {target} at {folder}"


_HANDLES: dict[tuple[int, str], int] = {}


def handle(device: int, entry: dict[str, Any]) -> int:
    """The loaded variant's handle on ``device`` (the cubin loaded on first use)."""
    key = (device, entry["cubin"])
    h = _HANDLES.get(key)
    if h is None:
        with _LOCK:
            h = _HANDLES.get(key)
            if h is None:
                folder = manifest(device_target(device).name)[0]
                h = _HANDLES[key] = extension().load(
                    device, (folder / entry["cubin"]).read_bytes(), entry["function"], int(entry["shared_bytes"]),
                    int(entry["num_warps"]), bool(entry["launch_pdl"]), entry["codes"], entry["descs"])
    return h


def find_variant(device: int, kernel: Any, args: tuple, kwargs: dict[str, Any]
                 ) -> tuple[dict[str, Any], list[tuple[str, str, Any]]] | str:
    """The manifest variant Triton's JIT would compile for ``kernel[grid](*args, **kwargs)`` on ``device`` and the
    launch's runtime arguments; or why none is built. A kernel of :data:`GENERIC_BITWISE` whose exact variant is
    missing takes the one that assumes no alignment and no divisibility."""
    target = device_target(device)
    if target is None:
        return f"no AOT target for cuda:{device}"
    variants = manifest(target.name)[2]
    key, bound, spec, _ = _plan.specialize(target, kernel, args, kwargs)
    entry = variants.get(key)
    if entry is None and kernel.__name__ in GENERIC_BITWISE:
        key, bound, spec, _ = _plan.specialize(target, kernel, args, kwargs, generic=True)
        entry = variants.get(key)
    if entry is None:
        return f"no AOT variant {kernel.__name__}{_plan.describe(spec)}"
    return entry, _plan.runtime_values(bound, spec)


# -- deciding a call: the plan on the call's tensors, no launch ------------------------------------------------------
def _holds(t: torch.Tensor, address: int) -> bool:
    """Whether ``address`` is the address of an element of the view ``t`` (its strides taken largest first: the
    layouts of slices, transposes and head views, which do not overlap)."""
    offset, size = address - t.data_ptr(), t.element_size()
    if offset < 0 or offset % size:
        return False
    offset //= size
    for n, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: -d[1]):
        i = offset // stride if stride else 0
        if i >= n:
            return False
        offset -= i * stride
    return offset == 0


class Decide(Plan):
    """A plan's launches on ``inputs`` (the call's tensors, flattened) found in the manifest but not made; the
    buffers allocated (unfilled) so that each pointer can be told apart. :meth:`program` is the packed record when
    every argument is an input, a buffer, a held tensor or a number, else None (``why`` says; ``reason`` is the
    first launch no variant serves, which declines the call)."""

    def __init__(self, device: torch.device, inputs: list[torch.Tensor | None]) -> None:
        self.device, self.index = device, device.index or 0
        self.sms, self.tma = _plan.device_facts(device)
        self.inputs = inputs
        self.buffers: list[tuple[torch.Tensor, str]] = []
        self.launches: list[tuple[int, tuple[int, int, int], list[tuple[int, ...]]]] = []
        self.reason: str | None = None
        self.why: str | None = None  # why the launches are not one program

    def _not_a_program(self, why: str) -> None:
        self.why = self.why or why

    def new(self, shape, dtype, fill="empty"):
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.buffers.append((t, fill))
        return t

    def contiguous(self, x, dtype=None):
        dtype = dtype or x.dtype
        if x.dtype == dtype and x.is_contiguous():
            return x
        self._not_a_program("the plan copies an input")
        return torch.empty(x.shape, dtype=dtype, device=self.device)  # its address stands for the copy's

    def host(self, fn, *args, **kwargs):
        self._not_a_program("the plan works on the host between launches")
        return fn(*args, **kwargs)

    def free(self, *tensors):
        self._not_a_program("the plan frees a buffer between launches")
        ids = {id(t) for t in tensors}
        self.buffers = [(b, f) for b, f in self.buffers if id(b) not in ids]

    def launch(self, kernel, grid, *args, **kwargs):
        if self.reason is not None:
            return
        found = find_variant(self.index, kernel, args, kwargs)
        if isinstance(found, str):
            self.reason = found
            return
        entry, values = found
        encoded = [self._encode(name, ty, v) for name, ty, v in values]
        if all(e is not None for e in encoded):
            grid3 = (tuple(grid) + (1, 1))[:3]
            self.launches.append((handle(self.index, entry), grid3, encoded))

    def _where(self, address: int) -> tuple[int, int, int] | None:
        """``(IN or BUF, index, byte offset)`` of an address: an input or buffer starting there, else the one input
        or buffer one of whose elements it is (two: ambiguous, None); ``(ADDR, address, 0)`` in a held tensor."""
        places = [(IN, i, t) for i, t in enumerate(self.inputs) if isinstance(t, torch.Tensor)]
        places += [(BUF, i, b) for i, (b, _) in enumerate(self.buffers)]
        for kind, i, t in places:
            if t.data_ptr() == address:
                return kind, i, 0
        holders = [(kind, i, t) for kind, i, t in places if t.numel() and _holds(t, address)]
        if len(holders) == 1:
            kind, i, t = holders[0]
            return kind, i, address - t.data_ptr()
        if not holders and _plan.is_held(address):
            return ADDR, address, 0
        return None

    def _encode(self, name: str, ty: str, v: Any) -> tuple[int, ...] | None:
        if ty.startswith("tensordesc"):
            where = self._where(v.base.data_ptr())
            if where is None or len(v.shape) != 2 or v.strides[1] != 1:
                self._not_a_program(f"descriptor {name} is over a tensor the call does not own")
                return None
            return (DESC, *where, int(v.shape[0]), int(v.shape[1]), int(v.strides[0]))
        if ty.startswith("*"):  # (None is a constexpr: never a runtime pointer)
            where = self._where(v.data_ptr())
            if where is None:
                self._not_a_program(f"pointer {name} is into a tensor the call does not own")
                return None
            return (*where, 0, 0, 0, 0)
        if ty == "fp32":
            return (FLOAT, struct.unpack("<q", struct.pack("<d", float(v)))[0], 0, 0, 0, 0, 0)
        return (INT, int(v), 0, 0, 0, 0, 0)

    def program(self, outs: list[torch.Tensor], ret: int) -> bytes | None:
        """The packed record ``_C.run_program`` reads (csrc/rlk_cuda.cpp), or None (``why``)."""
        if self.why is not None or self.reason is not None:
            return None
        index = {id(b): i for i, (b, _) in enumerate(self.buffers)}
        if any(id(o) not in index for o in outs):
            self._not_a_program("the plan returns a tensor that is not one of its buffers")
            return None
        words = [self.index, len(self.buffers)]
        for b, fill in self.buffers:
            if b.dtype not in SCALAR_TYPES:
                self._not_a_program(f"a buffer of dtype {b.dtype}")
                return None
            words += [SCALAR_TYPES[b.dtype], _plan.FILLS.index(fill), b.dim(), *b.shape]
        words.append(len(self.launches))
        for h, grid, args in self.launches:
            words += [h, *grid, len(args)]
            for a in args:
                words += a
        words += [len(outs), *(index[id(o)] for o in outs), ret]
        return array("q", words).tobytes()


class Run(Plan):
    """A plan run on the device from Python: each launch found in the manifest and made by ``_C.launch``."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.index = device, device.index or 0
        self.sms, self.tma = _plan.device_facts(device)

    new, contiguous, host = _plan.JitPlan.new, _plan.JitPlan.contiguous, _plan.JitPlan.host

    def launch(self, kernel, grid, *args, **kwargs):
        found = find_variant(self.index, kernel, args, kwargs)
        if isinstance(found, str):
            raise RuntimeError(f"rlk.cuda called on a launch it declines: {found}")
        entry, values = found
        grid3 = (tuple(grid) + (1, 1))[:3]
        extension().launch(handle(self.index, entry), *grid3, *[
            (v.base, int(v.shape[0]), int(v.shape[1]), int(v.strides[0])) if ty.startswith("tensordesc") else v
            for _, ty, v in values])


# -- the backend ----------------------------------------------------------------------------------------------------
def _flat(args: tuple) -> list[Any]:
    """The call's arguments with lists of tensors spread out: the inputs a program's ``IN`` arguments index."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def signature(args: tuple) -> tuple:
    """What a decision depends on: per tensor shape, strides, dtype, device and address modulo 16; the scalars."""
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15))
        elif isinstance(a, (list, tuple)):
            key.append(tuple((t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15) for t in a))
        else:
            key.append(a)
    return tuple(key)


def _returns(out: Any) -> tuple[list[torch.Tensor], int | None]:
    """The tensors a plan returned, in order, and how a program gives them back (None: a list, rebuilt in Python)."""
    if out is None:
        return [], RET_NONE
    if isinstance(out, torch.Tensor):
        return [out], RET_ONE
    if isinstance(out, tuple) and all(isinstance(o, torch.Tensor) for o in out):
        return list(out), RET_TUPLE
    flat = [t for o in out for t in (o if isinstance(o, list) else [o])]
    return flat, None


class Decision:
    __slots__ = ("packed", "rebuild", "ret", "said")

    def __init__(self, said: tuple[bool, str], packed: bytes | None, ret: int | None, rebuild: Any) -> None:
        self.said, self.packed, self.ret, self.rebuild = said, packed, ret, rebuild


_DECISIONS: dict[tuple, Decision] = {}


def _rebuild_like(out: Any):
    """A function that puts a program's flat outputs back into the shape of ``out`` (tuples of tensors and lists)."""
    shape = [len(o) if isinstance(o, list) else None for o in out]

    def rebuild(flat: tuple) -> Any:
        it, res = iter(flat), []
        for n in shape:
            res.append([next(it) for _ in range(n)] if n is not None else next(it))
        return tuple(res)
    return rebuild


class CudaOp:
    """The ``rlk.cuda`` side of one op: its plan and ``rlk.triton``'s ``supports``, with one decision per call
    signature (see the module docstring)."""

    def __init__(self, op: str, plan: str, supports: str | None) -> None:
        self.op, self.plan_path, self.supports_path = op, plan, supports
        self.plan: Any = None
        self.triton_supports: Any = None
        # the decision :meth:`supports` just made and the arguments it was made for: the backend's run that follows
        # it in one dispatch (on the very same objects) takes it instead of computing the call signature again
        self._told: tuple[tuple, Decision] | None = None

    def decision(self, args: tuple) -> Decision:
        key = (self.op, signature(args))
        hit = _DECISIONS.get(key)
        if hit is not None:
            return hit
        if self.plan is None:
            self.plan = resolve_fn(self.plan_path)
            self.triton_supports = resolve_fn(self.supports_path) if self.supports_path else None
        said = self.triton_supports(*args) if self.triton_supports is not None else (True, "")
        packed, ret, rebuild = None, None, None
        if said[0]:
            decide = Decide(first_tensor(args).device, _flat(args))
            out = self.plan(decide, *args)
            outs, ret = _returns(out)
            if decide.reason is not None:
                said = (False, decide.reason)
            else:
                packed = decide.program(outs, RET_TUPLE if ret is None else ret)
                rebuild = None if ret is not None else _rebuild_like(out)
        if len(_DECISIONS) >= MAX_DECISIONS:
            _DECISIONS.clear()
        decision = _DECISIONS[key] = Decision(said, packed, ret, rebuild)
        return decision

    def supports(self, *args: Any) -> tuple[bool, str]:
        for t in (first_tensor(args),):
            if t.is_meta or _is_fake(t):
                return NO_STORAGE
        d = self.decision(args)
        self._told = (args, d)
        return d.said

    def run(self, *args: Any) -> Any:
        told, self._told = self._told, None  # used once: a later call recomputes (its tensors may have changed)
        if told is not None and len(told[0]) == len(args) and all(a is b for a, b in zip(told[0], args, strict=True)):
            d = told[1]
        else:
            d = self.decision(args)
        if d.packed is not None:
            outs = extension().run_program(d.packed, *_flat(args))
            if outs is not None:  # else a buffer was not 16-byte aligned: nothing launched
                if d.ret == RET_ONE:
                    return outs[0]
                if d.ret == RET_NONE:
                    return None
                return outs if d.rebuild is None else d.rebuild(outs)
        return self.plan(Run(first_tensor(args).device), *args)


NO_STORAGE = (False, "fake or meta inputs (torch.compile tracing): no data pointer to decide on; rlk.triton, "
                     "the same bits, stands for it")
OPS: dict[str, CudaOp] = {}


def cuda_backend(op: str, plan: str, supports: str | None = None) -> Backend:
    """The ``rlk.cuda`` :class:`Backend` of ``op``: its launch plan (``"module:function"``, rlk.triton's) served by
    the AOT cubins; bitwise ``rlk.triton``'s, so where it declines a call ``rlk.triton`` runs it and that is not a
    fallback."""
    served = OPS[op] = CudaOp(op, plan, supports)
    return Backend(id=BACKEND_ID, op=op, fn=served.run, devices=("cuda",), priority=PRIORITY, available=available,
                   supports=served.supports, builtin=True, same_bits_as=SAME_BITS_AS[BACKEND_ID])


def decided_program(op: str, args: tuple) -> tuple[bytes, int] | None:
    """``(packed program, return kind)`` the call was decided into, where it runs as one program on exactly its own
    arguments (no list among them): what the fast path may repeat (:mod:`rlk_core.ops._dispatch`)."""
    served = OPS.get(op)
    if served is None or any(isinstance(a, (list, tuple)) for a in args):
        return None
    d = _DECISIONS.get((op, signature(args)))
    if d is None or d.packed is None or d.ret is None:
        return None
    return d.packed, d.ret


def clear() -> None:
    """Forget every decision (after a change of what they depend on: a held tensor replaced, a manifest or device
    monkeypatched in tests), and what the fast path learnt from them."""
    _DECISIONS.clear()
    if _EXT:
        _EXT[0].fast_clear()


_plan.on_invalidate(clear)
