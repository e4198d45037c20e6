"""CPU stand-ins for the ``rlk.cuda`` tests: manifest entries written without compiling, a recording ``rlk_core._C``,
the capture of ``rlk.triton``'s own kernel launches and the JIT's specialisation of each (Triton's binder).

Nothing here launches: ``Recorder`` keeps ``(handle, grid, arguments)`` of every ``_C.launch`` / ``_C.run`` /
``_C.run_program`` (the packed records decoded word by word as ``csrc/rlk_cuda.cpp`` reads them), and
:class:`TritonLaunches` keeps every ``kernel[grid](...)`` the Triton launchers make (their outputs stay unwritten).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import struct
import types
from array import array
from pathlib import Path
from typing import Any

import torch

from rlk_core.aot import specs as S
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _cuda_common as cc

build = importlib.import_module("rlk_core.aot.build")


def entry(spec: S.Spec) -> dict:
    """A manifest entry as the build writes it, without compiling: the signature and the cubin's parameter list
    from the build's own functions, a TMA encoding per descriptor (box as the Triton-level box)."""
    sig, const, divisible = build.triton_signature(spec)
    metas = [
        {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": list(dict(spec.descriptors)[name]),
         "fp4_padded": False}
        for name, ty in sig.items() if ty.startswith("tensordesc")
    ]
    return {"op": spec.op, "kernel": spec.kernel, "module": spec.module, "dtype": spec.dtype, "layout": spec.layout,
            "variant": spec.name, "constexprs": const, "plain": list(spec.plain), "divisible_by_16": divisible,
            "signature": [{"name": k, "type": v} for k, v in sig.items()], "params": build.cubin_params(sig, metas),
            "tensordesc_meta": metas or None, "cubin": f"{spec.kernel}-{abs(hash(spec.key)):x}.cubin",
            "function": spec.kernel, "num_warps": spec.num_warps, "num_stages": spec.num_stages,
            "options": dict(spec.options), "shared_bytes": 0, "launch_pdl": spec.launch_pdl,
            "global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1,
            "compile_key": build.compile_key(spec)}


def write_manifest(folder: Path, specs: list[S.Spec]) -> dict:
    doc = {"format": 1, "target": "cuda:90", "triton_version": "x", "sms": 132, "kernels": [entry(s) for s in specs]}
    (folder / "manifest.json").write_text(json.dumps(doc))
    return doc


class Recorder(types.ModuleType):
    """``rlk_core._C`` without a GPU: ``launch``, ``run`` and ``run_program`` record ``(handle, grid, arguments)``
    per launch, decoding the packed records as the C++ does; buffers are allocated (``run_program`` fills them)
    on the inputs' device, nothing is computed."""

    def __init__(self) -> None:
        super().__init__("rlk_core._C")
        self.calls: list[tuple] = []
        self.via: list[str] = []  # per launch: "launch", "run" or "run_program"

    def clear(self) -> None:
        self.calls.clear()
        self.via.clear()

    # -- the fast path, as csrc/rlk_cuda.cpp's (CPU tensors stand for CUDA ones; no dispatch-key-set check) --------
    def fast_init(self, scope_var, miss, plain_types) -> None:
        self._scope_var, self._miss, self._plain = scope_var, miss, tuple(plain_types)
        self.fast_reset()

    def fast_reset(self) -> None:
        self._entries: dict = {}
        self._scopes: dict = {}
        self._key_sets: set[int] = set()

    def fast_entries(self) -> int:
        return len(getattr(self, "_entries", {}))

    def _signature(self, args, teach: bool = False) -> tuple | None:
        key = []
        for a in args:
            if a is None or type(a) in (bool, int, float):
                key.append((type(a).__name__, a))
            elif isinstance(a, torch.Tensor) and type(a) in self._plain and not a.is_meta:
                if torch.is_grad_enabled() and a.requires_grad:
                    return None
                ks = torch._C._dispatch_keys(a).raw_repr()
                if ks not in self._key_sets:
                    if not teach:
                        return None
                    self._key_sets.add(ks)
                key.append((ks, a.dtype, a.device, a.data_ptr() & 15, tuple(a.shape), a.stride()))
            else:
                return None
        return tuple(key)

    def fast_teach(self, slot, program, packed, mapping, extras, rebuild, *args) -> bool:
        key = self._signature(args, teach=True)
        if key is None:
            return False
        self._entries[(slot, key)] = (program, packed, list(mapping), tuple(extras), rebuild)
        return True

    def fast_scope(self, scope, slot, graph, record) -> None:
        self._scopes[(id(scope), slot, graph)] = (scope, record)

    def fast(self, slot, *args):
        key = self._signature(args)
        if key is None or os.environ.get("RLK_VALUE_CHECKS") == "always":
            return self._miss
        hit = self._entries.get((slot, key))
        if hit is None:
            return self._miss
        program, packed, mapping, extras, rebuild = hit
        scope, record = self._scope_var.get(), None
        if scope is not None:
            found = self._scopes.get((id(scope), slot, False))
            if found is None:
                return self._miss
            record = found[1]
        inputs = [extras[-1 - m] if m < 0 else args[m - cc.TRANSPOSED].t() if m >= cc.TRANSPOSED else args[m]
                  for m in mapping]
        out = (self.run_program if program else self.run)(packed, *inputs)
        if out is None and (program or array("q", packed)[6] >= 0):
            return self._miss
        self.via[-1] = "fast"
        if record is not None:
            record.call_count += 1
        return out[0] if rebuild else out

    def launch(self, handle, gx, gy, gz, *args):
        self.calls.append((handle, (gx, gy, gz), list(args)))
        self.via.append("launch")

    @staticmethod
    def _slice(t: torch.Tensor, offset: int) -> tuple[str, int, int]:
        return ("at", t.data_ptr() + offset, t.untyped_storage().data_ptr())

    def _args(self, pairs, inputs, bufs):
        args = []
        for kind, value in pairs:
            if kind == cc.T or kind == cc.S:
                args.append(inputs[value])
            elif kind == cc.V:
                args.append(inputs[value].view(-1, inputs[value].shape[-1]))
            elif kind == cc.R:
                args.append(inputs[value].view(inputs[value].shape[0], -1))
            elif kind in (cc.O, cc.B):
                args.append(bufs[0 if kind == cc.O else value])
            elif kind == cc.F:
                args.append(struct.unpack("<d", struct.pack("<q", value))[0])
            elif kind in (cc.TA, cc.BA):
                t = (inputs if kind == cc.TA else bufs)[value & 255]
                args.append(self._slice(t, value >> 8))
            else:
                assert kind == cc.C, kind
                args.append(value)
        return args

    def run(self, packed, *inputs):
        words = list(array("q", packed))
        handle, out_aligned, gx, gy, gz, like = words[:6]
        at = 6
        n_alloc = words[at]
        alloc = words[at + 1:at + 1 + max(n_alloc, 0)]
        at += 1 + len(alloc)
        final = words[at + 1:at + 1 + words[at]]
        at += 1 + len(final)
        n = words[at]
        pairs = [(words[at + 1 + 2 * i], words[at + 2 + 2 * i]) for i in range(n)]
        assert at + 1 + 2 * n == len(words)
        bufs = []
        if n_alloc >= 0:
            y = torch.empty(alloc, dtype=inputs[like].dtype, device=inputs[like].device)
            if out_aligned and y.data_ptr() % 16:
                return None
            bufs.append(y)
        else:
            assert not out_aligned and not final
        self.calls.append((handle, (gx, gy, gz), self._args(pairs, inputs, bufs)))
        self.via.append("run")
        return bufs[0].view(final) if bufs else None

    def run_program(self, packed, *inputs):
        words = list(array("q", packed))
        like, n_bufs = words[0], words[1]
        at, bufs = 2, []
        dtypes = {code: getattr(torch, name) for name, code in cl.SCALAR_TYPES.items()}
        for _ in range(n_bufs):
            code, fill, ndim = words[at:at + 3]
            shape = words[at + 3:at + 3 + ndim]
            at += 3 + ndim
            t = torch.empty(shape, dtype=dtypes[code], device=inputs[like].device)
            if fill == 1:
                t.fill_(float("-inf"))
            elif fill == 2:
                t.zero_()
            if t.data_ptr() % 16:
                return None
            bufs.append(t)
        n_launches = words[at]
        at += 1
        for _ in range(n_launches):
            handle, gx, gy, gz, n = words[at:at + 5]
            at += 5
            pairs = [(words[at + 2 * i], words[at + 2 * i + 1]) for i in range(n)]
            at += 2 * n
            self.calls.append((handle, (gx, gy, gz), self._args(pairs, inputs, bufs)))
            self.via.append("run_program")
        n_outs = words[at]
        outs = tuple(bufs[i] for i in words[at + 1:at + 1 + n_outs])
        assert at + 1 + n_outs == len(words)
        return outs


@contextlib.contextmanager
def fake_device(monkeypatch, folder: Path, *modules: Any):
    """Lookups as on an sm_90 device with 132 SMs (CPU tensors stand for its tensors); handles are integers,
    ``entries[handle]`` their manifest entries; ``_C`` is a :class:`Recorder`. ``modules``: ``rlk.cuda`` op modules
    whose ``functools.cache``s (``_variant``, ``_plan``) hold handles, cleared before and after."""
    import rlk_core

    monkeypatch.setenv("RLK_AOT_DIR", str(folder))
    monkeypatch.setattr(cc, "_device_target", lambda device: "cuda:90")
    handles: dict[str, int] = {}
    entries: list[dict] = []

    def handle(device, e):
        if e["cubin"] not in handles:
            handles[e["cubin"]] = len(entries)
            entries.append(e)
        return handles[e["cubin"]]

    monkeypatch.setattr(cc, "handle", handle)
    ext = Recorder()
    monkeypatch.setitem(__import__("sys").modules, "rlk_core._C", ext)
    monkeypatch.setattr(rlk_core, "_C", ext, raising=False)
    monkeypatch.setattr(cc, "_EXT", [])
    from rlk_core.ops import _dispatch

    monkeypatch.setattr(_dispatch, "_FAST", [None])  # the fast path set up on the Recorder, undone with the fake

    def clear():
        cc._manifest.cache_clear()
        cc.clear_records()
        for m in modules:
            for name in ("_variant", "_plan", "_manifest_sms"):
                f = getattr(m, name, None)
                if f is not None and hasattr(f, "cache_clear"):
                    f.cache_clear()

    clear()
    try:
        yield ext, entries
    finally:
        clear()


# -- rlk.triton's own launches, and the JIT's specialisation of each ----------------------------------------
class TritonLaunches:
    """Within the context, every ``@triton.jit`` launch is recorded instead of run: ``(kernel, grid, args,
    kwargs)`` (outputs are left unwritten)."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, tuple, tuple, dict]] = []

    def __enter__(self) -> TritonLaunches:
        from triton.runtime.jit import JITFunction

        self._saved = JITFunction.run
        launches = self.launches

        def run(kernel, *args, grid, warmup, **kwargs):
            launches.append((kernel, tuple(grid) + (1,) * (3 - len(grid)), args, kwargs))

        JITFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._saved


_BINDERS: dict[Any, Any] = {}


def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return make_backend(GPUTarget("cuda", 90, 32))


def jit_key(kernel, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict[str, Any], set[str], dict[str, Any]]:
    """What Triton's JIT compiles for ``kernel[grid](*args, **kwargs)`` on sm_90, through its own binder (the
    code ``JITFunction.run`` runs): the signature's types by name (``constexpr`` for constants), the constexprs'
    values, the names marked divisible by 16, and the options that differ the binaries."""
    from triton.runtime.jit import create_function_from_signature

    backend = _backend()
    binder = _BINDERS.get(kernel)
    if binder is None:
        binder = _BINDERS[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*args, **kwargs)
    names = list(bound)
    sig = {n: s[0] for n, s in zip(names, specialization)}
    const = {n: bound[n] for n, s in zip(names, specialization) if s[0] == "constexpr"}
    divisible = {n for n, s in zip(names, specialization) if isinstance(s[1], str) and "D" in s[1]}
    opts = backend.parse_options({k: v for k, v in kwargs.items() if k not in names})
    return sig, const, divisible, {"num_warps": opts.num_warps, "num_stages": opts.num_stages,
                                   "enable_fp_fusion": opts.enable_fp_fusion}


def jit_compile_key(kernel, args: tuple, kwargs: dict) -> str:
    """Triton's compile (and cache) key of what its JIT compiles for ``kernel[grid](*args, **kwargs)`` on sm_90:
    ``JITFunction.run``'s own steps (its binder, ``_pack_args``, the ``ASTSource``, ``get_cache_key``) short of
    compiling. Equal to :func:`rlk_core.aot.build.compile_key` of a variant, the JIT's compile of the launch *is*
    the AOT build's compile of that variant."""
    import hashlib

    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_key
    from triton.runtime.jit import create_function_from_signature

    backend = _backend()
    binder = _BINDERS.get(kernel)
    if binder is None:
        binder = _BINDERS[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug  # as JITFunction.run
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    opts = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, opts, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def spec_key(e: dict) -> tuple[dict[str, str], dict[str, Any], set[str], dict[str, Any]]:
    """The same four facts of a manifest entry (a variant as the build compiles it)."""
    sig = {a["name"]: a["type"] for a in e["signature"]}
    return sig, dict(e["constexprs"]), set(e["divisible_by_16"]), {
        "num_warps": e["num_warps"], "num_stages": e["num_stages"],
        "enable_fp_fusion": e["options"].get("enable_fp_fusion", True)}


def canon(value: Any, code: str, roots: list[tuple[Any, torch.Tensor]]):
    """A launch argument by what it means: a tensor by which root's storage it points into and where (and, for a
    descriptor, its shape and strides; a Triton ``TensorDescriptor`` the same way), a scalar by value."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):
        return (*canon(value.base, "p", roots), tuple(value.shape), tuple(value.strides))
    if isinstance(value, tuple) and value and value[0] == "at":  # a Recorder slice: (at, address, storage)
        _, address, storage = value
        for name, t in roots:
            if t.untyped_storage().data_ptr() == storage:
                return (name, address - storage)
        return ("other",)
    if isinstance(value, torch.Tensor):
        where = ("other",)
        for name, t in roots:
            if value.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                where = (name, value.data_ptr() - t.untyped_storage().data_ptr())
                break
        return (*where, tuple(value.shape), tuple(value.stride())) if code == "D" else where
    if value is None:
        return None
    return float(value) if code == "f" else int(value)


class _Buffers:
    """Numbers the storages that are no root (buffers a launcher allocated) in order of first appearance."""

    def __init__(self, roots: list[tuple[Any, torch.Tensor]]) -> None:
        self.roots = {t.untyped_storage().data_ptr(): name for name, t in roots}
        self.seen: dict[int, int] = {}

    def name(self, storage: int) -> Any:
        if storage in self.roots:
            return self.roots[storage]
        return ("buffer", self.seen.setdefault(storage, len(self.seen)))

    def canon(self, value: Any, code: str) -> Any:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if isinstance(value, TensorDescriptor):
            return (*self.canon(value.base, "p"), tuple(value.shape), tuple(value.strides))
        if isinstance(value, tuple) and value and value[0] == "at":
            _, address, storage = value
            return (self.name(storage), address - storage)
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage().data_ptr()
            where = (self.name(storage), value.data_ptr() - storage)
            return (*where, tuple(value.shape), tuple(value.stride())) if code == "D" else where
        if value is None:
            return None
        return float(value) if code == "f" else int(value)


def same_launches(triton: list, calls: list, entries: list[dict], roots_triton: list, roots_cuda: list) -> None:
    """rlk.cuda's launches (``Recorder.calls``) are rlk.triton's (:class:`TritonLaunches`): the same kernels in the
    same order, each on the variant the JIT compiles for rlk.triton's launch (:func:`jit_key` == the entry's
    :func:`spec_key`, and Triton's compile key of the two the same: :func:`jit_compile_key`), the same grid and the
    same runtime arguments — scalars by value, pointers by where they point (a root by name, a buffer by its order
    of first appearance, and the byte offset)."""
    assert [k.__name__ for k, *_ in triton] == [entries[h]["kernel"] for h, *_ in calls], (
        [k.__name__ for k, *_ in triton], [entries[h]["kernel"] for h, *_ in calls])
    bt, bc = _Buffers(roots_triton), _Buffers(roots_cuda)
    for (kernel, grid, args, kwargs), (h, grid_c, args_c) in zip(triton, calls, strict=True):
        e = entries[h]
        jit = jit_key(kernel, args, kwargs)
        assert jit == spec_key(e), (e["variant"], [(a, b) for a, b in zip(jit, spec_key(e)) if a != b])
        assert jit_compile_key(kernel, args, kwargs) == e["compile_key"], e["variant"]
        assert tuple(grid) == tuple(grid_c), (e["variant"], grid, grid_c)
        bound = dict(zip(kernel.arg_names, args))
        bound.update(kwargs)
        runtime = [n for n, ty in jit[0].items() if ty != "constexpr"]
        assert len(runtime) == len(args_c) == len(e["codes"]), e["variant"]
        for name, code, value in zip(runtime, e["codes"], args_c):
            assert bt.canon(bound[name], code) == bc.canon(value, code), (e["variant"], name, bound[name], value)


def roots(args: tuple, out) -> list[tuple[str, torch.Tensor]]:
    """The call's tensors (list arguments flattened) and its outputs, by name: where a pointer may point."""
    found = []
    for i, a in enumerate(args):
        for j, t in enumerate(a if isinstance(a, list) else [a]):
            if isinstance(t, torch.Tensor):
                found.append((f"arg{i}.{j}", t))
    return found + [(f"out{i}", t) for i, t in enumerate(_flat(out)) if isinstance(t, torch.Tensor)]


def _flat(out) -> list:
    """An op's outputs as one list of tensors (or Nones): a tuple's items, a list of shards' items."""
    if not isinstance(out, (tuple, list)):
        return [out]
    return [t for o in out for t in _flat(o)]


def check_served_like_triton(cases, ext, entries: list[dict], via, as_launched=lambda launches: launches) -> int:
    """Every ``(op, args, want)`` of ``cases``: rlk.cuda's ``supports`` says ``want`` (a decline with a reason); a
    served call launches what rlk.triton launches (``as_launched`` of them: e.g. as on an sm_90 device) when its
    signature is first decided and again from the kept record or program, through ``_C`` entry points ``via(op,
    args, used)`` accepts, with outputs of rlk.triton's shapes, dtypes and strides. Returns the served count."""
    from _cuda_cases import describe

    from rlk_core.backends import REGISTRY

    served = 0
    for op, args, want in cases:
        cuda, triton = REGISTRY.get(op, "rlk.cuda"), REGISTRY.get(op, "rlk.triton")
        said = cuda.supports(*args)
        assert said[0] == want and (said[0] or said[1]), (op, said, describe(args))
        if not said[0]:
            continue
        with TritonLaunches() as cap:
            ref = triton.fn(*args)
        for _ in range(2):  # the decision, then the kept one
            ext.clear()
            out = cuda.fn(*args)
            same_launches(as_launched(cap.launches), ext.calls, entries, roots(args, ref), roots(args, out))
            assert via(op, args, set(ext.via)), (op, ext.via)
            for a, b in zip(*(_flat(o) for o in (ref, out)), strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), op
        served += 1
    return served
