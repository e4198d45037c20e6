"""CPU stand-ins for the ``rlk.cuda`` tests: a manifest of the AOT build's variants (enumerated, not compiled), a
``rlk_core._C`` that decodes program records word by word as ``csrc/rlk_cuda.cpp`` does and records each launch
with its arguments instead of making it, its fast path's bookkeeping as the C++ keeps it, and a device that CPU
tensors stand for (an sm_90 part of 132 SMs, so the plans choose as on an H200).

A recorded launch is ``(kernel name, grid, args)`` with every pointer as ``(tensor, byte offset)`` — the tensor it
points into (an input of the call, or a buffer the program allocated) — so it can be held against the launches
``rlk.triton``'s JIT makes for the same call (:class:`JitLaunches`)."""

from __future__ import annotations

import contextlib
import json
import struct
import types
from array import array
from pathlib import Path
from typing import Any

import torch

from rlk_core.aot import build as B
from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _cuda, _plan

SCALAR = {v: k for k, v in _cuda.SCALAR_TYPES.items()}


def write_manifest(folder: Path, families=tuple(B.FAMILIES), dtypes=("bf16", "fp16", "fp32")) -> dict:
    """The manifest a build of ``families`` for ``dtypes`` writes, without compiling: each variant's key, kernel,
    launcher codes (from its signature) and a descriptor encoding per TMA argument (its box from the signature)."""
    entries = []
    for i, v in enumerate(B.enumerate_variants(families, dtypes)):
        metas = [{"block_size": [int(n) for n in ty.split("[")[1].rstrip("]>").split(",")], "swizzle": 3,
                  "elem_size": 2, "elem_type": 10, "fp4_padded": False}
                 for ty in v["signature"].values() if ty.startswith("tensordesc")]
        codes, descs, params = B.param_codes(v["signature"], metas)
        entries.append({k: v[k] for k in ("key", "family", "module", "kernel", "spec", "generic")} | {
            "cubin": f"{v['kernel']}-{i}.cubin", "function": v["kernel"], "codes": codes, "descs": descs,
            "params": params, "shared_bytes": 0, "num_warps": v["options"]["num_warps"],
            "launch_pdl": bool(v["options"].get("launch_pdl"))})
        (folder / entries[-1]["cubin"]).write_bytes(b"")  # what the fake load is handed
    doc = {"format": B.FORMAT, "target": "cuda:90", "triton_version": __import__("triton").__version__,
           "sms": 132, "kernels": entries, "failed": []}
    (folder / "manifest.json").write_text(json.dumps(doc))
    return doc


class FakeC(types.ModuleType):
    """``rlk_core._C`` without a GPU (see the module docstring). ``launches`` holds every launch made, ``via`` how
    (``launch`` from Python, ``program``, or ``fast`` for a program the fast path ran)."""

    def __init__(self) -> None:
        super().__init__("rlk_core._C")
        self.variants: list[tuple[str, str]] = []  # handle -> (kernel, codes)
        self.launches: list[tuple[str, tuple[int, int, int], list]] = []
        self.via: list[str] = []
        self.fast_setup(None, None, [])

    def clear(self) -> None:
        self.launches.clear()
        self.via.clear()

    def load(self, device, cubin, name, shared, num_warps, pdl, codes, descs) -> int:
        self.variants.append((name, codes))
        return len(self.variants) - 1

    def launch(self, handle, gx, gy, gz, *args) -> None:
        name, codes = self.variants[handle]
        assert len(args) == len(codes), (name, codes, len(args))
        out = []
        for c, a in zip(codes, args, strict=True):
            if c == "p":
                out.append(None if a is None else (a, 0))
            elif c == "D":
                t, rows, cols, stride = a
                out.append(("desc", (t, 0), rows, cols, stride))
            else:
                out.append(a)
        self._record("launch", name, (gx, gy, gz), out)

    def _record(self, via: str, name: str, grid: tuple, args: list) -> None:
        self.launches.append((name, tuple(grid), args))
        self.via.append(via)

    def run_program(self, record: bytes, *inputs, via: str = "program"):
        w = array("q", record)
        at = 0

        def nxt() -> int:
            nonlocal at
            at += 1
            return w[at - 1]
        nxt()  # device
        bufs = []
        for _ in range(nxt()):
            dtype, fill, nd = SCALAR[nxt()], _plan.FILLS[nxt()], nxt()
            shape = [nxt() for _ in range(nd)]
            bufs.append(torch.full(shape, float("-inf"), dtype=dtype) if fill == "-inf" else
                        torch.zeros(shape, dtype=dtype) if fill == "zeros" else torch.empty(shape, dtype=dtype))

        def base(kind: int, index: int, offset: int):
            if kind == _cuda.IN:
                return inputs[index], offset
            if kind == _cuda.BUF:
                return bufs[index], offset
            assert kind == _cuda.ADDR, kind
            return ("address", index), 0

        for _ in range(nxt()):
            name, codes = self.variants[nxt()]
            grid = (nxt(), nxt(), nxt())
            n = nxt()
            assert n == len(codes), (name, n, codes)
            args = []
            for c in codes:
                kind, a, b, cc, d, e, f = (nxt() for _ in range(7))
                if kind in (_cuda.IN, _cuda.BUF, _cuda.ADDR):
                    assert c == "p", (name, c)
                    args.append(base(kind, a, b))
                elif kind == _cuda.INT:
                    args.append(a)
                elif kind == _cuda.FLOAT:
                    args.append(struct.unpack("<d", struct.pack("<q", a))[0])
                else:
                    assert kind == _cuda.DESC and c == "D", (name, kind, c)
                    args.append(("desc", base(a, b, cc), d, e, f))
            self._record(via, name, grid, args)
        outs = tuple(bufs[nxt()] for _ in range(nxt()))
        ret = nxt()
        assert at == len(w) and ret in (0, 1, 2), (at, len(w), ret)
        return outs

    # -- the fast path, as csrc/rlk_cuda.cpp's (CPU tensors stand for CUDA ones; no dispatch-key-set check) --------
    def fast_setup(self, scope_var, miss, plain_types) -> None:
        self._scope_var, self._miss, self._plain = scope_var, miss, tuple(plain_types)
        self.fast_clear()

    def fast_clear(self) -> None:
        self._entries: dict = {}
        self._scopes: dict = {}

    def fast_size(self) -> int:
        return len(self._entries)

    def _signature(self, args) -> tuple | None:
        key = []
        for a in args:
            if a is None or type(a) in (bool, int, float):
                key.append((type(a), a))
            elif type(a) in self._plain:
                if torch.is_grad_enabled() and a.requires_grad:
                    return None
                key.append((a.dtype, tuple(a.shape), a.stride(), a.data_ptr() & 15))
            else:
                return None
        return tuple(key)

    def fast_store(self, slot, packed, *args) -> bool:
        key = self._signature(args)
        if key is None:
            return False
        self._entries[(slot, key)] = packed
        return True

    def fast_count_into(self, scope, slot, graph, record) -> None:
        self._scopes[(id(scope), slot, graph)] = (scope, record)

    def fast(self, slot, *args):
        import os

        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None or os.environ.get("RLK_VALUE_CHECKS") == "always":
            return self._miss
        key = self._signature(args)
        packed = self._entries.get((slot, key)) if key is not None else None
        if packed is None:
            return self._miss
        scope = self._scope_var.get()
        record = None
        if scope is not None:
            hit = self._scopes.get((id(scope), slot, False))
            if hit is None:
                return self._miss
            record = hit[1]
        outs = self.run_program(packed, *args, via="fast")
        if record is not None:
            record.call_count += 1
        ret = array("q", packed)[-1]
        return outs[0] if ret == 0 else None if ret == 2 else outs


@contextlib.contextmanager
def fake_device(monkeypatch, folder: Path, ops=None):
    """Within the context: the manifest in ``folder``, a device of capability 9.0 and 132 SMs that CPU tensors stand
    for, ``rlk_core._C`` a :class:`FakeC` (with the fast path set up on it), and ``rlk.cuda`` registered for CPU
    tensors for ``ops`` (default: every op it serves) above the CPU's own backends. Yields the :class:`FakeC`."""
    import sys

    import rlk_core
    from rlk_core.ops import _dispatch

    monkeypatch.setenv("RLK_AOT_DIR", str(folder))
    target = _plan.Target("cuda", 90, 32)
    target.name = "cuda:90"
    monkeypatch.setattr(_cuda, "device_target", lambda index: target)
    real_facts = _plan.device_facts
    monkeypatch.setattr(_plan, "device_facts", lambda device: (132, True) if device.type == "cpu" else real_facts(
        device))
    ext = FakeC()
    monkeypatch.setitem(sys.modules, "rlk_core._C", ext)
    monkeypatch.setattr(rlk_core, "_C", ext, raising=False)
    monkeypatch.setattr(_cuda, "_EXT", [])
    monkeypatch.setattr(_cuda, "_HANDLES", {})
    monkeypatch.setattr(_dispatch, "_FAST", [None])
    _cuda.manifest.cache_clear()
    _cuda.clear()
    builtin = {op: REGISTRY.get(op, _cuda.BACKEND_ID) for op in (ops or _cuda.OPS)}
    for op in builtin:
        served = _cuda.OPS[op]
        REGISTRY.register(Backend(_cuda.BACKEND_ID, op, served.run, devices=("cpu",), priority=100,
                                  supports=served.supports, builtin=True, same_bits_as="rlk.triton"), replace=True)
    try:
        _cuda.extension()  # as the first rlk.cuda call would: the fast path set up on the fake
        yield ext
    finally:
        for backend in builtin.values():
            REGISTRY.register(backend, replace=True)
        _cuda.manifest.cache_clear()
        _cuda.clear()


class JitLaunches:
    """Within the context, every launch ``rlk.triton``'s plans make is recorded instead of run, in the form
    :class:`FakeC` records (pointers as ``(tensor, 0)``, descriptors by their base), buffers allocated as always."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple[int, int, int], list]] = []

    def __enter__(self) -> JitLaunches:
        self._saved = _plan.JitPlan.launch

        def launch(p, kernel, grid, *args, **kwargs):
            _, bound, spec, _ = _plan.specialize(_cuda.device_target(0), kernel, args, kwargs)
            out = []
            for _, ty, v in _plan.runtime_values(bound, spec):
                if ty.startswith("tensordesc"):
                    out.append(("desc", (v.base, 0), int(v.shape[0]), int(v.shape[1]), int(v.strides[0])))
                elif ty.startswith("*"):
                    out.append(None if v is None else (v, 0))
                else:
                    out.append(v)
            self.launches.append((kernel.__name__, (tuple(grid) + (1, 1))[:3], out))

        _plan.JitPlan.launch = launch
        return self

    def __exit__(self, *exc) -> None:
        _plan.JitPlan.launch = self._saved


def canonical(launches: list, roots: list[torch.Tensor]) -> list:
    """Launches with every pointer as ``(root index, byte offset)``: the root (an input or an output of the call)
    whose memory holds it, else ``("buffer", n)`` in order of first appearance, ``("address", a)`` as recorded."""
    seen: dict[int, int] = {}

    def where(ref):
        t, off = ref
        if isinstance(t, tuple):
            return t
        addr = t.data_ptr() + off
        for i, r in enumerate(roots):
            start = r.untyped_storage().data_ptr()
            if start <= addr < start + max(r.untyped_storage().nbytes(), 1):
                return (i, addr - r.data_ptr())
        if _plan.is_held(addr):
            return ("address", addr)
        key = t.untyped_storage().data_ptr()
        seen.setdefault(key, len(seen))
        return ("buffer", seen[key], addr - key)

    out = []
    for name, grid, args in launches:
        c = []
        for a in args:
            if isinstance(a, tuple) and a and a[0] == "desc":
                c.append(("desc", where(a[1]), *a[2:]))
            elif isinstance(a, tuple):
                c.append(where(a))
            elif isinstance(a, float):
                c.append(struct.unpack("<f", struct.pack("<f", a))[0])
            else:
                c.append(a)
        out.append((name, grid, c))
    return out


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result, in order (lists and tuples spread out)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []
