"""``rlk.cuda``'s cached launch records on the CPU: for a sweep of shapes, dtypes, strides and alignments, the
decision a call signature keeps (``supports`` and the :class:`~rlk_core.ops._cuda_common.Launch` that ``_C.run``
expands) is the one the general code computes without a cache — the same ``supports`` answer and, for every
call served, the same variant handle, grid and kernel arguments. Nothing launches here: ``_C`` is a recorder,
and its ``run`` reads the packed record as ``csrc/rlk_cuda.cpp`` does. The launches themselves are checked
bitwise against ``rlk.triton`` on the GPU (``tests/gpu/test_cuda_backend_gpu.py``)."""

from __future__ import annotations

import importlib
import json
import sys
import types
from array import array

import pytest
import torch

import rlk_core
from rlk_core.aot import specs as S
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops import linear as _linear_op  # noqa: F401  (registers the backends)

pytest.importorskip("triton")
build = importlib.import_module("rlk_core.aot.build")
lin = importlib.import_module("rlk_core.ops.linear.cuda")
rms = importlib.import_module("rlk_core.ops.rms_norm.cuda")
sw = importlib.import_module("rlk_core.ops.swiglu.cuda")
rp = importlib.import_module("rlk_core.ops.rope.cuda")


def _entry(spec: S.Spec) -> dict:
    """A manifest entry as the build writes it, without compiling (as tests/core/test_cuda_backend.py)."""
    sig, const, _ = build.triton_signature(spec)
    metas = [
        {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": list(dict(spec.descriptors)[name]),
         "fp4_padded": False}
        for name, ty in sig.items() if ty.startswith("tensordesc")
    ]
    return {"op": spec.op, "kernel": spec.kernel, "dtype": spec.dtype, "layout": spec.layout, "variant": spec.name,
            "constexprs": const, "signature": [{"name": k, "type": v} for k, v in sig.items()],
            "params": build.cubin_params(sig, metas), "tensordesc_meta": metas or None,
            "cubin": f"{spec.kernel}-{abs(hash(spec.key)):x}.cubin", "function": spec.kernel,
            "num_warps": spec.num_warps, "shared_bytes": 0, "launch_pdl": spec.launch_pdl,
            "global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1}


class Recorder(types.ModuleType):
    """``rlk_core._C`` without a GPU: ``launch`` and ``run`` record ``(handle, grid, arguments)``; ``run``
    decodes the packed record word by word as the C++ ``run`` does."""

    def __init__(self) -> None:
        super().__init__("rlk_core._C")
        self.calls: list[tuple] = []

    def launch(self, handle, gx, gy, gz, *args):
        self.calls.append((handle, (gx, gy, gz), list(args)))

    def run(self, packed, *inputs):
        words = list(array("q", packed))
        handle, out_aligned, gx, gy, gz, like = words[:6]
        at = 6
        alloc = words[at + 1:at + 1 + words[at]]
        at += 1 + len(alloc)
        final = words[at + 1:at + 1 + words[at]]
        at += 1 + len(final)
        n = words[at]
        pairs = [(words[at + 1 + 2 * i], words[at + 2 + 2 * i]) for i in range(n)]
        assert at + 1 + 2 * n == len(words)
        y = torch.empty(alloc, dtype=inputs[like].dtype, device=inputs[like].device)
        if out_aligned and y.data_ptr() % 16:
            return None
        args = []
        for kind, value in pairs:
            if kind == cc.T or kind == cc.S:
                args.append(inputs[value])
            elif kind == cc.V:
                args.append(inputs[value].view(-1, inputs[value].shape[-1]))
            elif kind == cc.O:
                args.append(y)
            else:
                assert kind == cc.C
                args.append(value)
        self.calls.append((handle, (gx, gy, gz), args))
        return y.view(final)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aot")
    kernels = [_entry(s) for s in S.enumerate_specs()]
    doc = {"format": 1, "target": "cuda:90", "triton_version": "x", "sms": 132, "kernels": kernels}
    (folder / "manifest.json").write_text(json.dumps(doc))
    return folder


@pytest.fixture
def fake(manifest, monkeypatch):
    """Lookups as on an sm_90 device with 132 SMs; handles are integers, ``codes[handle]`` their parameter
    codes; ``_C`` is a :class:`Recorder`."""
    monkeypatch.setenv("RLK_AOT_DIR", str(manifest))
    cc._manifest.cache_clear()
    monkeypatch.setattr(cc, "_device_target", lambda device: "cuda:90")
    handles: dict[str, int] = {}
    codes: list[str] = []

    def handle(device, entry):
        if entry["cubin"] not in handles:
            handles[entry["cubin"]] = len(codes)
            codes.append(entry["codes"])
        return handles[entry["cubin"]]

    monkeypatch.setattr(cc, "handle", handle)
    monkeypatch.setattr(lin, "_num_sms", lambda index: 132)
    ext = Recorder()
    monkeypatch.setitem(sys.modules, "rlk_core._C", ext)
    monkeypatch.setattr(rlk_core, "_C", ext, raising=False)
    monkeypatch.setattr(cc, "_EXT", [])

    def clear():
        cc._manifest.cache_clear()
        cc.clear_records()
        lin._plan.cache_clear()
        lin._manifest_sms.cache_clear()
        for m in (rms, sw, rp):
            m._variant.cache_clear()

    clear()
    yield ext, codes
    clear()


def _canon(value, code: str, out: torch.Tensor, inputs: tuple):
    """A kernel argument as what it means to the launch: a pointer by where it points (into input ``i`` or the
    output, at which byte offset; "copy" for a fresh copy the general code made of an input), a descriptor
    operand also by its shape and strides, a scalar by value."""
    if isinstance(value, torch.Tensor):
        storages = [("out", out)] + [(i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
        where = ("copy",)
        for name, t in storages:
            if value.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                where = (name, value.data_ptr() - t.untyped_storage().data_ptr())
                break
        return (*where, tuple(value.shape), value.stride()) if code == "D" else where
    if value is None:
        return None
    return float(value) if code == "f" else int(value)


def _same_launches(codes: list[str], inputs: tuple, old: torch.Tensor, old_calls: list, new: torch.Tensor,
                   new_calls: list) -> None:
    assert len(old_calls) == len(new_calls), (old_calls, new_calls)
    for (h0, g0, a0), (h1, g1, a1) in zip(old_calls, new_calls, strict=True):
        assert (h0, g0) == (h1, g1)
        c = codes[h0]
        assert len(a0) == len(a1) == len(c)
        assert [_canon(v, k, old, inputs) for v, k in zip(a0, c)] == [_canon(v, k, new, inputs) for v, k in zip(a1, c)]
    assert new.shape == old.shape and new.dtype == old.dtype and new.stride() == old.stride()


def _compare(fake, module, args: tuple) -> bool:
    """``supports`` == the general ``supports``; where served, the record's launches == the general code's.
    Returns whether the record path (no copy) served the call."""
    ext, codes = fake
    said = module.supports_general(*args)
    assert module.supports(*args) == said
    assert module.supports(*args) == said  # the cached answer
    if not said[0]:
        return False
    ext.calls.clear()
    old = module.forward_general(*args)
    old_calls = list(ext.calls)
    ext.calls.clear()
    new = module.forward(*args)
    new_calls = list(ext.calls)
    _same_launches(codes, args, old, old_calls, new, new_calls)
    ext.calls.clear()
    again = module.forward(*args)  # a hit: the same launches again
    _same_launches(codes, args, old, old_calls, again, list(ext.calls))
    return True


def _variants(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` contiguous, at a misaligned address, as a row slice of a wider buffer, and transposed back
    (a non-viewable layout: the general code copies it)."""
    out = [t]
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out.append(buf[1:].view(t.shape).copy_(t))
    if t.dim() >= 2:
        wide = torch.zeros((*t.shape[:-1], t.shape[-1] + 16), dtype=t.dtype)
        out.append(wide[..., : t.shape[-1]].copy_(t))
        out.append(t.transpose(-1, -2).contiguous().transpose(-1, -2))
    return out


def test_rms_norm_records_equal_the_general_code(fake):
    served = fast = 0
    for dt in S.DTYPES:
        for wdt in sorted({dt, torch.float32}, key=str):
            for h in (1, 7, 16, 100, 128, 1000, 1024, 4096, 5000):
                for shape in ((1, h), (37, h), (2, 3, h), (h,)):
                    for x in _variants(torch.randn(shape).to(dt)):
                        w = torch.randn(h).to(wdt)
                        for weight in (w, torch.randn(2 * h).to(wdt)[::2]):
                            served += _compare(fake, rms, (x, weight, 1e-6))
                            fast += rms._RECORDS[rms._signature(x, weight)][1] is not None
    assert served > fast > 100  # most served calls take the record; copies take the general code


def test_swiglu_records_equal_the_general_code(fake):
    served = fast = 0
    for dt in S.DTYPES:
        for inter in (1, 7, 16, 100, 128, 1000, 1024, 3072):
            for shape in ((1, 2 * inter), (23, 2 * inter), (2, 3, 2 * inter), (2 * inter,), (0, 2 * inter)):
                for x in _variants(torch.randn(shape).to(dt)):
                    served += _compare(fake, sw, (x,))
                    fast += sw._RECORDS[sw._signature(x)][1] is not None
    assert served > fast > 100


def test_rope_records_equal_the_general_code(fake):
    ext, codes = fake
    served = fast = 0
    for dt in S.DTYPES:
        for d, r in S.ROPE_SHAPES:
            for nh in (1, 2, 8, 16, 32, 40):
                for t in (1, 5):
                    for pdt in (torch.int32, torch.int64):
                        pos = torch.arange(t, dtype=pdt)
                        cos, sin = torch.randn(64, r // 2), torch.randn(64, r // 2)
                        for x in _variants(torch.randn(t, nh, d).to(dt)):
                            said = rp.supports_general(x, pos, 10000.0, r)
                            assert rp.supports(x, pos, 10000.0, r) == said
                            assert rp.supports(x, pos, 10000.0, r) == said
                            if not said[0]:
                                continue
                            for tables in ((cos, sin), (torch.randn(64 * (r // 2) + 1)[1:], sin)):
                                args = (x, pos, *tables, r)
                                ext.calls.clear()
                                old = rp.launch_general(*args)
                                old_calls = list(ext.calls)
                                for _ in range(2):  # the decision, then a hit
                                    ext.calls.clear()
                                    new = rp.launch(*args)
                                    _same_launches(codes, args, old, old_calls, new, list(ext.calls))
                                served += 1
                                key = (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, pos.dtype,
                                       pos.data_ptr() & 15, tables[0].data_ptr() & 15, tables[1].data_ptr() & 15, r)
                                fast += rp._LAUNCHES[key][0] is not None
    assert served > fast > 100


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
def test_linear_records_equal_the_general_code(fake, monkeypatch, tma):
    monkeypatch.setattr(lin, "has_tma", lambda index: tma)
    served = fast = 0
    for dt in S.DTYPES:
        for n, k in ((3072, 1024), (1536, 1024), (4096, 1040), (1024, 1000), (48, 64)):
            w = torch.randn(n, k).to(dt)
            for m in (0, 1, 16, 64, 100, 129, 1000):
                for bias in (None, torch.randn(n).to(dt)):
                    for shape in ((m, k), (1, m, k)):
                        for x in _variants(torch.randn(shape).to(dt))[:3]:
                            served += _compare(fake, lin, (x, w, bias))
                            fast += lin._RECORDS[lin._signature(x, w, bias)][1] is not None
    assert served > fast > 50


def test_a_changed_generic_set_needs_clear_records(fake, monkeypatch):
    """The decisions read :data:`GENERIC_BITWISE`; a test that changes it clears them (negative control: the
    kept answer is the old one until then)."""
    x = torch.empty(17, 4097, dtype=torch.bfloat16)[:, 1:]  # misaligned rows: the generic layout
    w = torch.randn(4096).to(torch.bfloat16)
    assert not rms.supports(x, w, 1e-6)[0]
    monkeypatch.setattr(cc, "GENERIC_BITWISE", cc.GENERIC_BITWISE | {"rms_norm"})
    assert not rms.supports(x, w, 1e-6)[0]
    cc.clear_records()
    assert rms.supports(x, w, 1e-6)[0]


def test_backend_functions_replace_their_stand_ins(fake):
    """``rlk.cuda``'s ``fn`` and ``supports`` import their module on first call and then are its functions
    (no wrapper per op call); a caller holding a stand-in still reaches the same function."""
    backend = cc.cuda_backend("swiglu")
    stand_in = backend.supports
    assert stand_in is not sw.supports
    x = torch.randn(3, 64)
    assert backend.supports(x) == sw.supports_general(x)
    assert backend.supports is sw.supports and backend.fn is not sw.forward
    assert stand_in(x) == sw.supports_general(x)
    y = backend.fn(x)
    assert backend.fn is sw.forward and y.shape == (3, 32)
