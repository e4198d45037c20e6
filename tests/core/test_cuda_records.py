"""``rlk.cuda``'s cached launch records on the CPU: for a sweep of shapes, dtypes, strides and alignments, the
decision a call signature keeps (``supports`` and the :class:`~rlk_core.ops._cuda_common.Launch` that ``_C.run``
expands) is the one the general code computes without a cache — the same ``supports`` answer and, for every
call served, the same variant handle, grid and kernel arguments. Nothing launches here: ``_C`` is a recorder,
and its ``run`` reads the packed record as ``csrc/rlk_cuda.cpp`` does. The launches themselves are checked
bitwise against ``rlk.triton`` on the GPU (``tests/gpu/test_cuda_backend_gpu.py``)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from rlk_core.aot import specs as S
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops import linear as _linear_op  # noqa: F401  (registers the backends)

pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cuda_cases as K
import _cuda_fakes as F

from rlk_core.ops.linear_logprobs import triton as llt

lin = importlib.import_module("rlk_core.ops.linear.cuda")
rms = importlib.import_module("rlk_core.ops.rms_norm.cuda")
sw = importlib.import_module("rlk_core.ops.swiglu.cuda")
rp = importlib.import_module("rlk_core.ops.rope.cuda")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aot")
    F.write_manifest(folder, S.enumerate_specs())
    return folder


@pytest.fixture
def fake(manifest, monkeypatch):
    """Lookups as on an sm_90 device with 132 SMs; handles are integers, ``entries[handle]`` their manifest
    entries; ``_C`` is a :class:`_cuda_fakes.Recorder`."""
    monkeypatch.setattr(lin, "_num_sms", lambda index: 132)
    with F.fake_device(monkeypatch, manifest, lin, rms, sw, rp) as (ext, entries):
        yield ext, entries


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


def _same_launches(entries: list[dict], inputs: tuple, old: torch.Tensor, old_calls: list, new: torch.Tensor,
                   new_calls: list) -> None:
    assert len(old_calls) == len(new_calls), (old_calls, new_calls)
    for (h0, g0, a0), (h1, g1, a1) in zip(old_calls, new_calls, strict=True):
        assert (h0, g0) == (h1, g1)
        c = entries[h0]["codes"]
        assert len(a0) == len(a1) == len(c)
        assert [_canon(v, k, old, inputs) for v, k in zip(a0, c)] == [_canon(v, k, new, inputs) for v, k in zip(a1, c)]
    assert new.shape == old.shape and new.dtype == old.dtype and new.stride() == old.stride()


def _compare(fake, module, args: tuple) -> bool:
    """``supports`` == the general ``supports``; where served, the record's launches == the general code's.
    Returns whether the record path (no copy) served the call."""
    ext, entries = fake
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
    _same_launches(entries, args, old, old_calls, new, new_calls)
    ext.calls.clear()
    again = module.forward(*args)  # a hit: the same launches again
    _same_launches(entries, args, old, old_calls, again, list(ext.calls))
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
    ext, entries = fake
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
                                    _same_launches(entries, args, old, old_calls, new, list(ext.calls))
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


# -- attention and log-prob ops: rlk.cuda launches what rlk.triton launches ----------------------------------
FAMILIES = {"attention": K.attention_forward_cases, "kv_cache_write": K.kv_cache_write_cases,
            "attention_backward": K.attention_backward_cases, "logp": K.logprob_cases,
            "linear_logp": K.linear_logprob_cases}


def _fast(op: str, args: tuple) -> bool:
    """Whether a served call needs no copy the record or program cannot make: the linear log-probs compute their
    logits between launches (from Python); int64 ``q_positions`` are converted per call."""
    if op in ("linear_logprobs", "linear_logp_partials"):
        return False
    return not (op == "attention_varlen" and args[7] is not None and args[7].dtype == torch.int64)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_and_logp_launches_are_triton_s(fake, monkeypatch, family):
    """Every call of the family's sweep (tests/core/_cuda_cases.py): ``supports`` takes exactly the calls meant to be
    served and declines the others with a reason; a served call launches what rlk.triton launches — the same
    kernels in order, each the variant the JIT compiles for rlk.triton's launch, the same grids and arguments
    (pointers by where they point: an input, an output or a buffer, at which offset) — when its signature is first
    decided and again from the kept record or program, which serves every call that needs no copy; the outputs
    have rlk.triton's shapes, dtypes and strides."""
    ext, entries = fake
    monkeypatch.setattr(llt, "CHUNK_BYTES", K.linear_chunk_bytes())
    def via(op, args, used):
        return used <= ({"run", "run_program"} if _fast(op, args) else {"launch"})

    served = F.check_served_like_triton(FAMILIES[family]("cpu"), ext, entries, via)
    assert served > 0


def test_decode_offsets_are_one_cached_arange_per_device(fake):
    """attention_decode's cu_seqlens_q is a prefix of one cached arange (rlk.triton builds arange(B + 1) per call):
    the values the kernel reads are the same; a larger batch grows it, the old tensor is kept (a captured graph may
    read it)."""
    from rlk_core.ops.attention import cuda as ac

    cu = ac.decode_offsets(torch.device("cpu"), 5)
    assert cu.dtype == torch.int32 and torch.equal(cu[:5], torch.arange(5, dtype=torch.int32))
    assert ac.decode_offsets(torch.device("cpu"), 7) is cu
    big = ac.decode_offsets(torch.device("cpu"), cu.shape[0] + 1)
    assert big.shape[0] > cu.shape[0] and torch.equal(big[: cu.shape[0]], cu) and any(t is cu for t in ac._KEEP)


def test_program_records_slices_and_buffers(fake):
    """A program names inputs, buffers and slices of both; what the C++ reads (decoded by the recorder) is what
    was meant: a slice of an input at its byte offset, a buffer's half, the fills."""
    ext, entries = fake
    x = torch.randn(4, 32)
    calls = cl.Calls(x.device, meta=True)
    buf = calls.new((2, 4, 8), torch.float32, "-inf")
    zero = calls.new((4,), torch.float32, "zeros")
    calls.launches.append(((entries_entry := F.entry(S.swiglu_specs(torch.float32)[0]), [cl.Slice(x, x[:, 16:]),
                            cl.Slice(buf, buf[1])], ["x_ptr", "y_ptr"]), (1, 1, 1)))
    program = calls.program((x,), (buf, zero))
    assert program is not None and entries_entry["cubin"] in {e["cubin"] for e in entries}
    ext.clear()
    outs = cl.run_program(program, x)
    (_, _, args), = ext.calls
    assert args[0] == ("at", x.data_ptr() + 16 * 4, x.untyped_storage().data_ptr())
    assert args[1][1] - args[1][2] == 4 * 8 * 4  # buf[1]: 32 floats in
    assert torch.isneginf(outs[0]).all() and torch.equal(outs[1], torch.zeros(4))
    assert calls.program((x,), (torch.empty(4),)) is None  # an output that is no buffer


def test_a_packed_record_says_whether_it_allocates_an_output():
    """``record_has_output`` reads the packed ``len(alloc)`` word (-1: the kernel writes into its inputs)."""
    from rlk_core.ops import _cuda_common as cc

    args = ((cc.T, 0), (cc.C, 7))
    writes_inputs = cc.Launch(5, (3, 1, 1), None, (), 0, False, args).pack()
    allocates = cc.Launch(5, (3, 1, 1), (4, 8), (4, 8), 0, True, args).pack()
    assert cc.record_handle(writes_inputs) == cc.record_handle(allocates) == 5
    assert not cc.record_has_output(writes_inputs) and cc.record_has_output(allocates)
