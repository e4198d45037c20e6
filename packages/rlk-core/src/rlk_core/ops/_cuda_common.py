"""Shared plumbing of the compiled backend ``rlk.cuda``: the AOT cubins of :mod:`rlk_core.aot` launched by
the C++ extension ``rlk_core._C`` (``csrc/rlk_cuda.cpp``).

``rlk.cuda`` runs the very binaries ``rlk.triton``'s JIT compiles — the same kernel sources, constexprs,
launch options and layout specialisation, built ahead of time by ``triton.compile`` — so its bits are
``rlk.triton``'s (the GPU suite compares them with ``torch.equal``). A launch is served only by a variant
whose specialisation is the one the JIT would compile for it:

- ``aligned`` — every pointer 16-byte aligned and every integer argument the kernel specialises divisible
  by 16 (the JIT's binary for exactly that pattern);
- ``generic`` — nothing assumed; another binary than the JIT's for a partly aligned launch, so used only
  for ops in :data:`GENERIC_BITWISE` (elementwise kernels with no reduction, whose bits cannot depend on
  vector width — checked bitwise on the GPU by ``tests/gpu/test_cuda_backend_gpu.py``).

Every other launch (integers past int32, a layout the rule above does not cover, a shape no variant was
built for: see the manifest's ``not_built``) is declined by ``supports`` and runs on ``rlk.triton``:
``rlk.cuda`` declares ``same_bits_as="rlk.triton"``, so that route is recorded as the backend that ran,
not as a fallback (the registry's strict mode refuses fallbacks that could change bits; this one cannot).

The manifest is found under ``RLK_AOT_DIR`` or the package data ``rlk_core/_aot/<target>/`` that
``setup.py`` installs with the extension. Variants are loaded on first use per device and cached.

Host time: each op's ``supports`` and launch share one decision per call signature (:class:`Launch`,
below), so a repeated call costs one dict lookup in ``supports`` and one in the launch, which is a single
``_C.run`` (output allocation, argument packing and ``cuLaunchKernelEx`` in C++). A call that was one such
record on the op's own arguments is then taught to ``_C.fast`` (:func:`lesson`; the fast path of
:mod:`rlk_core.ops._dispatch`), which repeats the whole op call — selection, readback count, launch — in C++.

:mod:`rlk_core.ops._cuda_calls` builds on this for the attention and log-prob ops: a launch resolved against the
manifest exactly as the JIT would specialise it, and ops of several launches (``_C.run_program``).
"""

from __future__ import annotations

import functools
import importlib
import json
import threading
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlk_core import envs
from rlk_core.backends import Backend
from rlk_core.ops._checks import _PLAIN, _is_fake
from rlk_validate.evidence import SAME_BITS_AS

BACKEND_ID = "rlk.cuda"
PRIORITY = 20  # above rlk.triton (10): preferred where it can serve
TARGETS = {(9, 0): "cuda:90"}  # device capability -> AOT target whose cubins run there
GENERIC_BITWISE = frozenset({"swiglu", "rope"})
I32_MAX = 2**31 - 1
_LOCK = threading.Lock()


def target_dir_name(target: str) -> str:
    """``cuda:90`` -> ``cuda_90`` (the package-data folder)."""
    return target.replace(":", "_")


def aot_dir(target: str) -> Path:
    """Where the manifest and cubins of ``target`` are: ``$RLK_AOT_DIR`` (a build's output folder) or the
    installed package data."""
    override = envs.get("RLK_AOT_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "_aot" / target_dir_name(target)


def param_codes(entry: dict[str, Any]) -> tuple[str, list[list[int]]]:
    """The launcher's parameter codes of a manifest entry and its descriptors' encodings.

    One code per non-constexpr argument of the Triton signature, in order: ``p`` pointer, ``i`` int32,
    ``l`` int64, ``f`` fp32, ``D`` TMA descriptor (the C++ side expands it to the ``CUtensorMap``, shape and
    strides the cubin takes). The cubin's parameter list (``params``) is checked against that expansion,
    the two scratch pointers last. Descriptor encodings: ``[box0, box1, swizzle, elem_size, elem_type]``
    from ``tensordesc_meta`` (``elem_type`` in the device enum; ``rlk_core._C`` maps it as Triton does)."""
    codes, expanded, descs = [], [], []
    metas = iter(entry.get("tensordesc_meta") or [])
    for arg in entry["signature"]:
        ty = arg["type"]
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            codes.append("p")
            expanded.append(ty)
        elif ty in ("i32", "i64", "fp32"):
            codes.append({"i32": "i", "i64": "l", "fp32": "f"}[ty])
            expanded.append(ty)
        elif ty.startswith("tensordesc"):
            meta = next(metas)
            if meta is None or meta.get("fp4_padded"):
                raise ValueError(f"{entry.get('variant')}: descriptor {arg['name']} is not a plain TMA descriptor")
            block = list(meta["block_size"])
            if len(block) != 2:
                raise ValueError(f"{entry.get('variant')}: only 2-D descriptors are launched, got {block}")
            codes.append("D")
            expanded += ["CUtensorMap", "i32", "i32", "i64", "i64"]
            descs.append([*block, meta["swizzle"], meta["elem_size"], meta["elem_type"]])
        else:
            raise ValueError(f"{entry.get('variant')}: argument {arg['name']} of type {ty} has no launcher code")
    params = [p["type"] for p in entry["params"]]
    if params != expanded + ["*i8", "*i8"]:
        raise ValueError(
            f"{entry.get('variant')}: the cubin's parameters {params} are not the launcher's "
            f"{expanded} + two scratch pointers"
        )
    return "".join(codes), descs


def variant_key(kernel: str, dtype: str, layout: str, constexprs: dict[str, Any], plain: Any = ()) -> tuple:
    """A variant's identity for lookups: kernel, dtype string, layout class, constexprs (the unit integers
    included) and the integers an ``aligned`` variant leaves unmarked (``plain``)."""
    return (kernel, dtype, layout, json.dumps(sorted(constexprs.items())), tuple(sorted(plain)))


def index(manifest: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """The manifest's variants by :func:`variant_key`; entries that need scratch memory, clusters or a
    parameter the launcher cannot pass are left out (those launches go to ``rlk.triton``)."""
    out = {}
    for e in manifest["kernels"]:
        if e.get("global_scratch_size") or e.get("profile_scratch_size") or e.get("num_ctas", 1) != 1:
            continue
        try:
            codes, descs = param_codes(e)
        except ValueError:
            continue
        key = variant_key(e["kernel"], e["dtype"], e["layout"], e["constexprs"], e.get("plain", ()))
        out[key] = {**e, "codes": codes, "descs": descs}
    return out


@functools.cache
def _manifest(target: str) -> tuple[Path, dict[str, Any], dict[tuple, dict[str, Any]]]:
    folder = aot_dir(target)
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest.get("target") != target:
        raise RuntimeError(f"{folder}/manifest.json is for {manifest.get('target')}, not {target}")
    return folder, manifest, index(manifest)


@functools.cache
def _device_target(device: int) -> str | None:
    import torch

    return TARGETS.get(torch.cuda.get_device_capability(device))


def available() -> tuple[bool, str]:
    """``(ok, reason)``: ``rlk_core._C`` importable, a CUDA device whose capability has an AOT target, that
    target's manifest present and built by the installed Triton version's sources (a cubin of other
    kernel sources would not be ``rlk.triton``'s binary)."""
    import torch

    if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        extension()  # imported once, its fast path set up
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

        _, manifest, idx = _manifest(target)
        if manifest["triton_version"] != triton.__version__:
            return False, (
                f"cubins built by Triton {manifest['triton_version']}, rlk.triton runs "
                f"{triton.__version__}: not the same binaries"
            )
    except Exception as exc:  # a broken manifest is an unavailable backend, with the reason
        return False, f"AOT manifest at {folder}: {type(exc).__name__}: {exc}"
    return True, f"{len(idx)} AOT variants for {target} at {folder}"


def lookup(device: int, kernel: str, dtype: str, layout: str, constexprs: dict[str, Any],
           plain: Any = ()) -> dict[str, Any] | None:
    """The manifest entry for these constexprs (and unmarked integers) on ``device``'s target, or None."""
    target = _device_target(device)
    if target is None:
        return None
    return _manifest(target)[2].get(variant_key(kernel, dtype, layout, constexprs, plain))


_HANDLES: dict[tuple[int, str], int] = {}


def handle(device: int, entry: dict[str, Any]) -> int:
    """The loaded variant's handle on ``device`` (loads the cubin on first use)."""
    key = (device, entry["cubin"])
    h = _HANDLES.get(key)
    if h is None:
        with _LOCK:
            h = _HANDLES.get(key)
            if h is None:
                from rlk_core import _C

                folder = _manifest(_device_target(device))[0]
                cubin = (folder / entry["cubin"]).read_bytes()
                h = _C.load(
                    device,
                    cubin,
                    entry["function"],
                    int(entry["shared_bytes"]),
                    int(entry["num_warps"]),
                    bool(entry["launch_pdl"]),
                    entry["codes"],
                    entry["descs"],
                )
                _HANDLES[key] = h
    return h


def aligned(*tensors_and_ints: Any) -> bool:
    """The JIT's ``aligned`` pattern: every tensor's data pointer and every integer divisible by 16."""
    for a in tensors_and_ints:
        if isinstance(a, int):
            if a % 16:
                return False
        elif a.data_ptr() % 16:
            return False
    return True


def fits_i32(*ints: int) -> bool:
    return all(-I32_MAX - 1 <= i <= I32_MAX for i in ints)


def cuda_backend(op: str, module: str | None = None, fn: str = "forward", supports: str = "supports") -> Backend:
    """The ``rlk.cuda`` :class:`Backend` of ``op`` (module default ``rlk_core.ops.<op>.cuda``), bitwise
    ``rlk.triton``'s: where it declines a call, ``rlk.triton`` runs it and that is not a fallback. ``fn`` and
    ``supports`` import the module on first use and then put its functions in their place (no wrapper
    call per op call)."""
    module = module or f"rlk_core.ops.{op}.cuda"
    backend = Backend(
        id=BACKEND_ID,
        op=op,
        fn=_binding(module, fn, "fn"),
        devices=("cuda",),
        priority=PRIORITY,
        available=available,
        supports=_binding(module, supports, "supports"),
        builtin=True,
        same_bits_as=SAME_BITS_AS[BACKEND_ID],  # the validator reads the same table
    )
    backend.fn.backend = backend.supports.backend = backend
    return backend


def _binding(module: str, attr: str, field: str) -> Callable[..., Any]:
    """A stand-in for ``module.attr``: imports it on first call and puts it in the backend's ``field`` (where
    the stand-in still is), so the registry's calls reach it directly; a caller holding the stand-in pays one
    call more."""
    bound: list[Callable[..., Any]] = []

    def stand_in(*args: Any) -> Any:
        if not bound:
            bound.append(getattr(importlib.import_module(module), attr))
            if getattr(stand_in.backend, field) is stand_in:
                setattr(stand_in.backend, field, bound[0])
        return bound[0](*args)

    stand_in.__name__ = f"{module}.{attr}"
    stand_in.backend = None
    return stand_in


# -- trace time ---------------------------------------------------------------------------------------
NO_STORAGE = (False, "fake or meta inputs (torch.compile tracing): no data pointer to decide on; rlk.triton, "
                     "the same bits, stands for it")


def without_storage(*tensors: Any) -> bool:
    """Whether any of ``tensors`` is a fake or meta tensor. ``supports`` reads data pointers (alignment) and
    shapes as plain ints, which a traced call does not have (a fake tensor's ``data_ptr()`` is 0 with a
    warning, or an error in newer torch; its shapes may be symbolic): it declines those calls instead of
    deciding on a guessed address. Plain tensors cost one type test each."""
    for t in tensors:
        if t is not None and (t.is_meta or (type(t) not in _PLAIN and _is_fake(t))):
            return True
    return False


# -- launch records: one decision per call signature -----------------------------------------------------
# ``supports`` and the launch of each op share one decision per call signature (a tuple of shapes, strides,
# dtypes, device and the pointers' low 4 bits: everything the decision reads), made once by the op's general
# code and kept as ``(said, launch)``: ``said`` is ``supports``' answer, ``launch`` a :class:`Launch` where
# the call needs no copy of its inputs, else None (the general code runs the call, as it decided).
# A hit is then one dict lookup and one ``_C.run``.

T, V, O, S, C = 0, 1, 2, 3, 4  # a launch argument: input tensor, input viewed 2-D, output, input scalar, constant
F, R, B, TA, BA = 5, 6, 7, 8, 9  # fp32 constant, input viewed [rows, -1], buffer, into an input, into a buffer
MAX_RECORDS = 16384  # per op; past it the cache starts over (shapes of a long run with varying batch sizes)


class Launch:
    """One launch of one variant for one call signature, in the form ``_C.run`` takes it: the handle, the
    grid, the output's shape at launch (``alloc``, allocated like input ``like``) and as returned (``final``,
    a view), whether the variant assumes a 16-byte aligned output (``out_aligned``: ``_C.run`` returns None
    where the allocation is not, and the general code runs the call) and per kernel argument ``(kind,
    value)``: ``(T, i)`` input ``i``, ``(V, i)`` input ``i`` viewed ``[-1, last]`` (a TMA descriptor
    operand), ``(R, i)`` input ``i`` viewed ``[rows, -1]`` (a descriptor over several heads of each row),
    ``(O, 0)`` the output, ``(S, i)`` the scalar input ``i``, ``(C, v)`` the integer ``v``, ``(F, bits)`` the
    fp32 constant whose double's bits are ``bits`` (:func:`float_bits`). ``alloc=None``: the kernel writes only
    into its inputs (``_C.run`` allocates nothing and returns None)."""

    __slots__ = ("alloc", "args", "final", "grid", "handle", "like", "out_aligned", "packed")

    def __init__(self, handle: int, grid: tuple[int, int, int], alloc: tuple[int, ...] | None,
                 final: tuple[int, ...], like: int, out_aligned: bool, args: tuple[tuple[int, int], ...]) -> None:
        self.handle, self.grid, self.final = handle, tuple(grid), tuple(final)
        self.alloc = None if alloc is None else tuple(alloc)
        self.like, self.out_aligned, self.args = like, bool(out_aligned), tuple(args)
        self.packed: bytes | None = None

    def pack(self) -> bytes:
        """The record as ``_C.run`` reads it: int64s ``[handle, out_aligned, gx, gy, gz, like, len(alloc),
        *alloc, len(final), *final, len(args), *(kind, value) per argument]`` (``len(alloc)`` -1: no output)."""
        alloc = () if self.alloc is None else self.alloc
        words = [self.handle, int(self.out_aligned), *self.grid, self.like,  # (len(alloc): word _ALLOC_WORD)
                 -1 if self.alloc is None else len(alloc), *alloc, len(self.final), *self.final, len(self.args)]
        for kind, value in self.args:
            words += [kind, value]
        return array("q", words).tobytes()


_EXT: list[Any] = []


def run(launch: Launch, *inputs: Any) -> Any:
    """``_C.run`` of ``launch`` on ``inputs``: the output (the ``final`` view), or None where the allocation
    is not 16-byte aligned and the variant assumes it is (the caller then runs its general code)."""
    packed = launch.packed
    if packed is None:
        packed = launch.packed = launch.pack()
    if not _EXT:
        extension()
    out = _EXT[0].run(packed, *inputs)
    if catch is not None:
        catch.append((False, packed, inputs, out, launch.alloc is None))
    return out


def extension() -> Any:
    """``rlk_core._C`` (imported once; its fast path set up: :func:`rlk_core.ops._dispatch.fast_path`)."""
    if not _EXT:
        from rlk_core import _C
        from rlk_core.ops import _dispatch

        _EXT.append(_C)
        _dispatch.extension_loaded()
    return _EXT[0]


def launch(handle: int, gx: int, gy: int, gz: int, *args: Any) -> None:
    """``_C.launch`` (a launch no record describes: the backend call is not taught to the fast path)."""
    if catch is not None:
        catch.append(None)
    extension().launch(handle, gx, gy, gz, *args)


# -- what one backend call launched: the fast path's lessons ----------------------------------------------------
# While rlk_core.ops._dispatch.run runs an rlk.cuda backend, ``catch`` is a list: every ``_C.run`` / ``_C.run_program``
# of a record appends ``(program, packed, inputs, result, no_output)``, and any other launch path (``launch_resolved``,
# an rlk op called inside the backend) appends None — a call that is one record and nothing else is what
# :func:`lesson` can teach ``_C.fast``.
catch: list | None = None
TRANSPOSED = 10000  # a fast-path input that is argument i's .t() (csrc/rlk_cuda.cpp's kTransposed)
_STABLE: dict[int, Any] = {}  # id -> tensor: tensors an op keeps alive for good (never written again)


def keep_stable(*tensors: Any) -> None:
    """Mark tensors an op keeps alive and never writes again (a reserved rope table, decode's offsets): a taught
    fast-path call may hold them in place of the Python code that looks them up. Their owner calls
    :func:`rlk_core.ops._dispatch.fast_reset` when it stops handing them out."""
    for t in tensors:
        _STABLE[id(t)] = t


def _transposed_arg(args: tuple, t: Any) -> int | None:
    """The argument ``t`` is the ``.t()`` of (a 2-D view of the same storage, sizes and strides swapped), or None."""
    if t.dim() != 2:
        return None
    for i, a in enumerate(args):
        if (type(a) in _PLAIN and a.dim() == 2 and a.data_ptr() == t.data_ptr() and a.dtype == t.dtype
                and tuple(a.shape) == tuple(t.shape)[::-1] and a.stride() == t.stride()[::-1]):
            return i
    return None


def lesson(args: tuple, out: Any, seen: list) -> tuple | None:
    """What ``_C.fast_teach`` needs to repeat a backend call on ``args`` that returned ``out`` and launched what
    ``seen`` holds (:data:`catch`): ``(program, packed, map, extras, rebuild)``, or None where that call was not
    exactly one record run on the arguments — another launch, a record that launched nothing, a result the backend
    changed, an input that is neither an argument, its transpose, a :func:`keep_stable` tensor, None nor a
    number (a copy the backend made)."""
    import torch

    if len(seen) != 1 or seen[0] is None:
        return None
    program, packed, inputs, result, no_output = seen[0]
    if result is None and not no_output:
        return None  # a misaligned allocation: nothing launched, the general code ran
    if out is result:
        rebuild = 0
    elif program and type(result) is tuple and result and out is result[0]:
        rebuild = 1
    else:
        return None
    mapping, extras = [], []
    for x in inputs:
        i = next((j for j, a in enumerate(args) if a is x), None)
        if i is not None:
            mapping.append(i)
            continue
        if isinstance(x, torch.Tensor):
            j = _transposed_arg(args, x) if type(x) in _PLAIN else None
            if j is not None:
                mapping.append(TRANSPOSED + j)
                continue
            if _STABLE.get(id(x)) is not x:
                return None
        elif not (x is None or type(x) in (int, float, bool)):
            return None
        mapping.append(-1 - len(extras))
        extras.append(x)
    return program, packed, mapping, tuple(extras), rebuild


def record_handle(packed: bytes) -> int:
    """The variant handle of a packed :class:`Launch` (what ``_C.run`` launches)."""
    return array("q", packed[:8])[0]


_ALLOC_WORD = 6  # Launch.pack's word len(alloc), after handle, out_aligned, the grid's three and like


def record_has_output(packed: bytes) -> bool:
    """Whether a packed :class:`Launch` allocates an output (else ``_C.run`` launches it and returns None: an op
    that writes into its arguments, ``kv_cache_write``)."""
    return array("q", packed[8 * _ALLOC_WORD:8 * _ALLOC_WORD + 8])[0] != -1


_RECORD_CACHES: list[dict] = []


def records() -> dict:
    """A new per-op cache of decisions, registered so that :func:`clear_records` empties it."""
    cache: dict = {}
    _RECORD_CACHES.append(cache)
    return cache


def remember(cache: dict, key: tuple, decision: tuple) -> tuple:
    if len(cache) >= MAX_RECORDS:
        cache.clear()
    cache[key] = decision
    return decision


def clear_records() -> None:
    """Forget every op's decisions (after changing what they depend on: :data:`GENERIC_BITWISE`, a
    monkeypatched device or manifest in tests), and what the fast path learnt from them."""
    from rlk_core.ops._dispatch import fast_reset

    for cache in _RECORD_CACHES:
        cache.clear()
    fast_reset()
