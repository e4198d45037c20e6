"""``rlk.cuda`` for the attention and log-prob ops: which AOT binary the JIT would run for a launch, and ops made
of several launches.

- :func:`resolve`: the Triton launcher's own launch (every argument by name, constexprs included, as
  ``kernel[grid](...)`` gets it) -> the manifest variant the JIT would compile for it — ``None`` and constexprs,
  integers equal to 1 folded to constants, integers not divisible by 16 left unmarked, pointers 16-byte aligned,
  the pointer types and launch options — or why none is (then ``supports`` declines and ``rlk.triton`` runs it).
  A meta tensor stands for a buffer the launch allocates (:func:`address_low_bits`), so a call is decided before
  its buffers exist.
- :class:`Calls`: an op's launches written once, as its Triton launcher writes them, either run now or decided on
  meta stand-ins; :class:`Served` keeps one decision per call signature and, where every argument is an input or a
  buffer of the call, a :class:`Program` that ``_C.run_program`` runs in one call (buffers allocated and filled,
  launches on pointers into inputs and buffers).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable
from typing import Any

from rlk_core.ops import _cuda_common as cc
from rlk_core.ops._cuda_common import BA, TA, B, C, F, Launch, O, R, T  # argument kinds


def float_bits(x: float) -> int:
    """The bits of ``x`` as a double, as an int64 (an ``F`` record argument; ``_C`` passes it as fp32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


# -- several launches per op call ------------------------------------------------------------------------
SCALAR_TYPES = {"int32": 3, "int64": 4, "float16": 5, "float32": 6, "bfloat16": 15}  # c10::ScalarType codes
FILLS = {"empty": 0, "-inf": 1, "zeros": 2}


class Program:
    """The launches of an op made of several kernels, for one call signature, in the form ``_C.run_program``
    takes it: buffers allocated per call like input ``like`` — ``(dtype name, fill, shape)`` each, ``fill`` one
    of :data:`FILLS` (as ``torch.empty`` / ``torch.full(-inf)`` / ``torch.zeros`` would, on the current stream)
    — then each launch ``(handle, grid, args)`` in order, its arguments as :class:`Launch`'s plus ``(B, b)``
    buffer ``b``, ``(TA, (i, bytes))`` a pointer into input ``i`` and ``(BA, (b, bytes))`` into buffer ``b`` (a
    slice); ``outs``, the buffers returned (a tuple)."""

    __slots__ = ("buffers", "launches", "like", "outs", "packed")

    def __init__(self, like: int, buffers: list[tuple[str, str, tuple[int, ...]]],
                 launches: list[tuple[int, tuple[int, int, int], list[tuple[int, Any]]]], outs: list[int]) -> None:
        self.like, self.buffers, self.launches, self.outs = like, list(buffers), list(launches), list(outs)
        self.packed: bytes | None = None

    def pack(self) -> bytes:
        """int64s ``[like, n_buffers, (scalar type, fill, ndim, *shape) each, n_launches, (handle, gx, gy, gz,
        n_args, (kind, value) each) each, n_outs, *outs]``; a slice's value is ``bytes << 8 | index``."""
        words = [self.like, len(self.buffers)]
        for dtype, fill, shape in self.buffers:
            words += [SCALAR_TYPES[dtype], FILLS[fill], len(shape), *shape]
        words.append(len(self.launches))
        for handle, grid, args in self.launches:
            words += [handle, *grid, len(args)]
            for kind, value in args:
                if kind in (TA, BA):
                    index, offset = value
                    assert 0 <= index < 256 and offset >= 0, value
                    value = offset << 8 | index
                words += [kind, value]
        words += [len(self.outs), *self.outs]
        return array("q", words).tobytes()


def run_program(program: Program, *inputs: Any) -> tuple | None:
    """``_C.run_program`` of ``program`` on ``inputs``: the output buffers, or None where an allocation is not
    16-byte aligned (nothing launched; the caller runs its general code)."""
    if program.packed is None:
        program.packed = program.pack()
    outs = cc.extension().run_program(program.packed, *inputs)
    if cc.catch is not None:
        cc.catch.append((True, program.packed, inputs, outs, False))
    return outs


# -- which binary the JIT would run: resolving a launch against the manifest -----------------------------
JIT_DEFAULTS = {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": True}  # Triton 3.6's CUDA options
POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32", "int64": "*i64"}


class Desc:
    """A TMA descriptor argument: the input ``source`` (``[rows, ...]``) viewed ``[rows, -1]`` — the 2-D tensor
    ``_C`` encodes the ``CUtensorMap`` from (``attention.triton.kv_descriptor`` describes the same view)."""

    __slots__ = ("source", "tensor")

    def __init__(self, source: Any) -> None:
        self.source, self.tensor = source, source.view(source.shape[0], -1)


def type_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).replace("torch.", "")


def address_low_bits(t: Any) -> int:
    """``t``'s address modulo 16; a meta tensor stands for a fresh allocation of torch's caching allocator
    (blocks 512-byte aligned): its address is its storage offset (a launch decided before its buffers exist)."""
    if t.is_meta:
        return t.storage_offset() * t.element_size() % 16
    return t.data_ptr() % 16


def resolve(device: int, kernel: Any, dtype: str, args: dict[str, Any],
            options: dict[str, Any]) -> tuple[dict[str, Any], list[Any], list[str]] | str:
    """The manifest variant the JIT would compile for ``kernel[grid](**args, **options)``, the launch's runtime
    arguments in the signature's order and their names; or why no variant is that binary.

    ``args`` names every argument of the ``@triton.jit`` function (constexprs too) as the Triton launcher
    passes it, a :class:`Desc` for a descriptor, a meta tensor for a buffer the launch allocates
    (:func:`address_low_bits`). Specialisation as the JIT's
    (``aot.specs.int_class``): ``None`` and constexprs are part of the variant, an integer equal to 1 becomes a
    constant, one not divisible by 16 stays unmarked (``plain``) unless it is ``do_not_specialize``; every
    pointer must be 16-byte aligned (the built class); integers past int32 are the JIT's i64 variant (not
    built). The variant's pointer types and ``num_warps`` / ``num_stages`` / ``enable_fp_fusion`` must be the
    launch's."""
    import torch

    from rlk_core.aot.specs import int_class

    const: dict[str, Any] = {}
    plain, values, names = [], [], []
    for p in kernel.params:
        v = args[p.name]
        if p.is_constexpr or v is None:
            const[p.name] = v
        elif isinstance(v, (Desc, Slice, torch.Tensor)):
            t = v.view if isinstance(v, Slice) else v
            if isinstance(t, torch.Tensor) and address_low_bits(t):
                return f"{p.name} is not 16-byte aligned (the JIT's unaligned specialisation is not built)"
            values.append(v)
            names.append(p.name)
        elif isinstance(v, float):
            values.append(v)
            names.append(p.name)
        elif isinstance(v, int) and not isinstance(v, bool):
            if not cc.fits_i32(v):
                return f"{p.name} = {v} does not fit int32 (the JIT's i64 specialisation is not built)"
            cls = "16" if p.do_not_specialize else int_class(v)
            if cls == "1":
                const[p.name] = 1
                continue
            if cls == "":
                plain.append(p.name)
            values.append(v)
            names.append(p.name)
        else:
            return f"{p.name}: a {type(v).__name__} argument has no launcher code"
    name = kernel.__name__
    entry = cc.lookup(device, name, dtype, "aligned", const, plain)
    if entry is None:
        shown = ",".join(f"{k}={v}" for k, v in sorted(const.items()) if not k.endswith(("_ptr", "_desc")))
        return f"no AOT variant {name}[{dtype},{shown}{',plain=' + '+'.join(plain) if plain else ''}]"
    want = {**JIT_DEFAULTS, **options}
    have = {**JIT_DEFAULTS, "num_warps": entry["num_warps"], "num_stages": entry["num_stages"], **entry["options"]}
    if want != have:
        return f"{entry['variant']} is built with {have}, the launch asks {want}"
    types = [a["type"] for a in entry["signature"] if a["type"] != "constexpr"]
    for v, ty in zip(values, types, strict=True):
        t = v.tensor if isinstance(v, Desc) else v.view if isinstance(v, Slice) else v
        if isinstance(t, torch.Tensor):
            elem = ty[1:] if ty.startswith("*") else ty[len("tensordesc<"):].split("[")[0]
            if POINTER_TYPES.get(type_name(t.dtype)) != "*" + elem:
                return f"{entry['variant']}: an argument of type {ty} gets a {t.dtype} tensor"
    return entry, values, names


def launch_of(handle: int, grid: tuple[int, int, int], values: list[Any], inputs: tuple, out: Any = None,
              final: tuple[int, ...] | None = None, like: int = 0) -> Launch | None:
    """The :class:`Launch` of resolved ``values`` (:func:`resolve`) where every tensor among them is one of
    ``inputs`` (by identity; a :class:`Desc` by its source) or ``out`` — the output the record allocates, a
    contiguous ``final`` like input ``like`` (``out=None``: the kernel writes into its inputs only) — else None
    (a copy or another tensor was made: the general code runs the call)."""
    import torch

    def index(t: Any) -> int | None:
        return next((i for i, x in enumerate(inputs) if x is t), None)

    args = []
    for v in values:
        if isinstance(v, Desc):
            i = index(v.source)
            if i is None:
                return None
            args.append((R, i))
        elif isinstance(v, torch.Tensor):
            if out is not None and v is out:
                args.append((O, 0))
                continue
            i = index(v)
            if i is None:
                return None
            args.append((T, i))
        elif isinstance(v, float):
            args.append((F, float_bits(v)))
        else:
            args.append((C, int(v)))
    if out is None:
        return Launch(handle, grid, None, (), like, False, tuple(args))
    return Launch(handle, grid, tuple(final), tuple(final), like, True, tuple(args))


def launch_resolved(device: int, resolved: tuple[dict[str, Any], list[Any], list[str]],
                    grid: tuple[int, int, int]) -> None:
    """``_C.launch`` of a :func:`resolve`-d launch (a :class:`Desc` passed as its 2-D tensor)."""
    entry, values, _ = resolved
    cc.launch(cc.handle(device, entry), *grid,
                   *[v.tensor if isinstance(v, Desc) else v.view if isinstance(v, Slice) else v for v in values])


def positional(kernel: Any, *args: Any, **constexprs: Any) -> dict[str, Any]:
    """``kernel``'s arguments by name from a positional launch ``kernel[grid](*args, **constexprs)`` (the
    Triton launchers' own call, written the same way), without launch options."""
    names = kernel.arg_names
    if len(args) + len(constexprs) != len(names):
        raise TypeError(f"{kernel.__name__} takes {len(names)} arguments, got {len(args)} + {sorted(constexprs)}")
    out = dict(zip(names, args))
    out.update(constexprs)
    return out


class Slice:
    """A pointer argument into ``base`` (an input or a buffer of the call) at the first element of ``view``, a
    view of it (a column range, one group's slots, one half of a buffer): a :class:`Program` records the offset."""

    __slots__ = ("base", "view")

    def __init__(self, base: Any, view: Any) -> None:
        self.base, self.view = base, view


class Calls:
    """The launches of one op call, written once as the Triton launcher writes them and either run
    (``meta=False``: buffers allocated, each launch resolved and made now) or decided (``meta=True``: buffers
    and copies are meta stand-ins, each launch resolved and kept — :meth:`program` turns them into a
    :class:`Program`; ``reason`` is the first launch no variant serves, None if all are served)."""

    def __init__(self, device: Any, meta: bool) -> None:
        self.device, self.meta = device, meta
        self.index = device.index if device.type == "cuda" else -1
        self.buffers: list[tuple[Any, str, str]] = []
        self.launches: list[tuple[tuple[dict[str, Any], list[Any], list[str]], tuple[int, int, int]]] = []
        self.reason: str | None = None

    def new(self, shape: Any, dtype: Any, fill: str = "empty") -> Any:
        """``torch.empty`` / ``torch.full(-inf)`` / ``torch.zeros`` of ``shape`` on the device (``fill``)."""
        import torch

        if self.meta:
            t = torch.empty(shape, dtype=dtype, device="meta")
            self.buffers.append((t, type_name(dtype), fill))
            return t
        if fill == "-inf":
            return torch.full(shape, float("-inf"), dtype=dtype, device=self.device)
        if fill == "zeros":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def contiguous(self, x: Any, dtype: Any = None) -> Any:
        """``x.to(dtype).contiguous()`` (``dtype`` default ``x``'s): ``x`` itself where that is ``x``, else the
        copy (a meta stand-in no :class:`Program` can take when deciding)."""
        import torch

        dtype = dtype or x.dtype
        if x.dtype == dtype and x.is_contiguous():
            return x
        if self.meta:
            return torch.empty(x.shape, dtype=dtype, device="meta")
        return x.to(dtype).contiguous()

    def launch(self, kernel: Any, grid: tuple[int, ...], args: dict[str, Any], options: dict[str, Any],
               dtype: str) -> None:
        grid = (tuple(grid) + (1, 1))[:3]
        r = resolve(self.index, kernel, dtype, args, options)
        if isinstance(r, str):
            if not self.meta:
                raise RuntimeError(f"rlk.cuda called on a launch it declines: {r}")
            self.reason = self.reason or r
            return
        if self.meta:
            self.launches.append((r, grid))
        else:
            launch_resolved(self.index, r, grid)

    def program(self, inputs: tuple, outs: tuple) -> Program | None:
        """The decided launches as a :class:`Program` over ``inputs`` (the op's tensor arguments, in the order
        ``run_program`` gets them) returning ``outs`` (buffers); None where an argument is neither an input, a
        buffer, nor a slice or descriptor of one (a copy the call makes), or a launch is not served."""
        import torch

        if self.reason is not None:
            return None

        def where(t: Any) -> tuple[int, int] | None:  # (kind, index)
            for i, x in enumerate(inputs):
                if x is t:
                    return T, i
            for i, (b, _, _) in enumerate(self.buffers):
                if b is t:
                    return B, i
            return None

        launches = []
        for (entry, values, _), grid in self.launches:
            args: list[tuple[int, Any]] = []
            for v in values:
                if isinstance(v, Desc):
                    w = where(v.source)
                    if w is None or w[0] != T:
                        return None
                    args.append((R, w[1]))
                elif isinstance(v, Slice):
                    w = where(v.base)
                    if w is None:
                        return None
                    offset = (v.view.storage_offset() - v.base.storage_offset()) * v.view.element_size()
                    args.append((TA if w[0] == T else BA, (w[1], offset)))
                elif isinstance(v, torch.Tensor):
                    w = where(v)
                    if w is None:
                        return None
                    args.append(w)
                elif isinstance(v, float):
                    args.append((F, float_bits(v)))
                else:
                    args.append((C, int(v)))
            launches.append((cc.handle(self.index, entry), grid, args))
        out_index = []
        for o in outs:
            w = where(o)
            if w is None or w[0] != B:
                return None
            out_index.append(w[1])
        like = next((i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)), 0)
        return Program(like, [(d, fill, tuple(b.shape)) for b, d, fill in self.buffers], launches, out_index)


class Served:
    """An op served through :class:`Calls`: ``body(calls, *args)`` makes its launches as the Triton launcher makes
    them and returns its outputs (a sequence); ``said(*args)`` is ``rlk.triton``'s own ``supports``; ``tensors(*args)``
    the call's tensor arguments (None where absent) in the order ``run_program`` takes them, ``scalars(*args)`` the
    rest (hashable); ``rebuild`` turns the outputs (the program's buffers, or ``body``'s run from Python) into the
    op's return value (a single tensor: ``lambda outs: outs[0]``).

    One decision per call signature (every tensor's shape, strides, dtype and address low bits, the scalars,
    the device): rlk.triton's answer, then the launches resolved on meta stand-ins (declined with the first
    reason no variant serves) and a :class:`Program` where every argument is an input or a buffer. A signature
    seen before is one dict lookup in :meth:`supports`; :meth:`run` right after it with the same argument objects
    (the registry's ``supports(*args)`` then ``fn(*args)``) takes what it found, else looks it up itself; then one
    ``_C.run_program``. Calls whose launches need a copy of an input run ``body`` from Python (the same
    launches)."""

    def __init__(self, name: str, body: Callable[..., Any], said: Callable[..., tuple[bool, str]],
                 tensors: Callable[..., tuple], scalars: Callable[..., tuple] = lambda *a: (),
                 rebuild: Callable[[tuple], Any] = tuple) -> None:
        self.name, self.body, self.said, self.tensors, self.scalars, self.rebuild = (
            name, body, said, tensors, scalars, rebuild)
        self.records = cc.records()
        self.last = cc.records()  # "call": the last supports() call's arguments and what it found (see run)

    def _decision(self, args: tuple) -> tuple[tuple, tuple]:
        flat = self.tensors(*args)
        key: list[Any] = [self.scalars(*args)]
        for t in flat:
            key.append(None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15))
        first = next(t for t in flat if t is not None)
        key.append(first.get_device())
        key_t = tuple(key)
        hit = self.records.get(key_t)
        if hit is not None:
            return hit, flat
        said, program = self.said(*args), None
        if said[0] and type_name(first.dtype) not in POINTER_TYPES:
            said = (False, f"no AOT variant for dtype {first.dtype}")
        if said[0]:
            calls = Calls(first.device, meta=True)
            outs = self.body(calls, *args)
            if calls.reason is not None:
                said = (False, calls.reason)
            elif calls.launches:
                program = calls.program(flat, tuple(outs))
        return cc.remember(self.records, key_t, (said, program)), flat

    def run(self, *args: Any) -> Any:
        kept, found = self.last.get("call", ((), None))  # the registry's fn(*args) after supports(*args)
        if len(kept) == len(args) and all(a is b for a, b in zip(kept, args)):
            (_, program), flat = found
        else:
            (_, program), flat = self._decision(args)
        if program is not None:
            outs = run_program(program, *flat)
            if outs is not None:
                return self.rebuild(outs)
        first = next(t for t in flat if t is not None)
        return self.rebuild(tuple(self.body(Calls(first.device, meta=False), *args)))

    def supports(self, *args: Any) -> tuple[bool, str]:
        if cc.without_storage(*self.tensors(*args)):
            return cc.NO_STORAGE
        found = self._decision(args)
        self.last["call"] = (args, found)
        return found[0][0]


def program_handles(packed: bytes) -> list[int]:
    """The variant handles a packed :class:`Program` launches, in order (what ``_C.run_program`` runs)."""
    words = array("q", packed)
    at = 2
    for _ in range(words[1]):  # buffers: scalar type, fill, ndim, sizes
        at += 3 + words[at + 2]
    handles, n_launches = [], words[at]
    at += 1
    for _ in range(n_launches):  # handle, gx, gy, gz, n_args, (kind, value) per argument
        handles.append(words[at])
        at += 5 + 2 * words[at + 4]
    return handles
