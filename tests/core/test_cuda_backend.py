"""``rlk.cuda`` on the CPU (``rlk_core.ops._cuda``): on a device CPU tensors stand for (``_cuda_fakes``), every call
of the sweeps is served or declined as expected, and a served call launches exactly what ``rlk.triton``'s JIT
launches for it — the same kernels, grids, integers, floats, pointers into the same inputs or buffers at the same
offsets, descriptors over the same memory — whether it ran as one program or from Python. The program records
are decoded as ``csrc/rlk_cuda.cpp`` decodes them (the C++ itself runs in ``tests/gpu/test_cuda_backend_gpu.py``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import _cuda, _plan

pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cuda_cases as cases
import _cuda_fakes as F

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aot")
    F.write_manifest(folder)
    return folder


@pytest.fixture
def device(manifest, monkeypatch):
    monkeypatch.setattr(_plan, "_JIT", {})  # rlk.triton's plans on the fake device's facts too
    with F.fake_device(monkeypatch, manifest) as ext:
        yield ext


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _misaligned(t):
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    return buf[1:].view(t.shape).copy_(t)


def all_cases():
    yield from cases.rowwise_and_linear_cases(CPU)
    yield from cases.attention_forward_cases(CPU)
    yield from cases.kv_cache_write_cases(CPU)
    yield from cases.attention_backward_cases(CPU)
    yield from cases.logprob_cases(CPU)
    yield from cases.backward_cases(CPU)


def _served(op, args):
    return REGISTRY.select(op, "cpu", args, False).backend.id == _cuda.BACKEND_ID


def test_every_case_is_served_or_declined_as_expected_and_launches_what_the_jit_launches(device):
    wrong, checked, programs = [], 0, 0
    for op, args, served in all_cases():
        said = _cuda.OPS[op].supports(*args)
        if said[0] != served:
            wrong.append((op, cases.describe(args), served, said[1]))
            continue
        if not served:
            assert said[1], (op, cases.describe(args))  # a declined call says why
            continue
        device.clear()
        out = _cuda.OPS[op].run(*args)
        via = set(device.via)
        with F.JitLaunches() as jit:
            want = _plan.resolve_fn(_cuda.OPS[op].plan_path)(_plan.jit_plan(CPU), *args)
        roots = F.tensors_of(args) + F.tensors_of(out)
        got = F.canonical(device.launches, roots)
        jit_roots = F.tensors_of(args) + F.tensors_of(want)
        assert got == F.canonical(jit.launches, jit_roots), (op, cases.describe(args), via)
        programs += via == {"program"}
        checked += 1
    assert not wrong, wrong[:10]
    assert checked > 1000 and programs > checked // 2, (checked, programs)


def test_a_declined_call_runs_on_rlk_triton_and_is_no_fallback(device):
    x = _rand(5, 1000)
    w = _rand(48, 1000)
    ok, why = _cuda.OPS["linear"].supports(x, w, None)
    assert not ok and "no AOT variant _linear_fwd_kernel" in why
    from rlk_core.backends import Backend, BackendRegistry

    reg = BackendRegistry()
    reg.register(Backend(_cuda.BACKEND_ID, "linear", lambda *a: None, devices=("cpu",), priority=20,
                         supports=_cuda.OPS["linear"].supports, builtin=True, same_bits_as="rlk.triton"))
    reg.register(Backend("rlk.triton", "linear", lambda *a: None, devices=("cpu",), priority=10, builtin=True))
    sel = reg.select("linear", "cpu", (x, w, None), True)
    assert sel.backend.id == "rlk.triton" and sel.fallback_reason is None and "no AOT variant" in sel.route_reason


def test_traced_inputs_are_declined_with_the_reason(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(_rand(4, 64)), mode.from_tensor(_rand(32, 64))
        assert _cuda.OPS["linear"].supports(x, w, None) == _cuda.NO_STORAGE
    meta = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    assert _cuda.OPS["swiglu"].supports(meta) == _cuda.NO_STORAGE


def test_a_call_needing_a_copy_runs_the_same_launches_from_python(device):
    x, w = _rand(64, 2048).t(), _rand(64)  # a transposed view: the plan copies it, so no program can hold it
    assert _cuda.OPS["rms_norm"].supports(x, w, 1e-6)[0]
    assert _cuda.OPS["rms_norm"].decision((x, w, 1e-6)).packed is None
    device.clear()
    _cuda.OPS["rms_norm"].run(x, w, 1e-6)
    assert device.via == ["launch"]


def test_decode_with_no_offsets_yet_makes_its_own_on_the_host_and_runs_from_python(device, monkeypatch):
    """A decode captured before any offsets tensor exists builds its own (``p.host(torch.arange, ..., dtype=...)``):
    rlk.cuda runs it from Python with the JIT's launches, not as a program."""
    from rlk_core.ops.attention import triton as at

    op, args, served = next(c for c in cases.attention_forward_cases(CPU) if c[0] == "attention_decode" and c[2])
    monkeypatch.setattr(at, "decode_offsets", lambda device, n: None)
    _cuda.clear()
    assert _cuda.OPS[op].decision(args).packed is None
    device.clear()
    out = _cuda.OPS[op].run(*args)
    assert device.via == ["launch"]
    with F.JitLaunches() as jit:
        want = at.attention_decode(_plan.jit_plan(CPU), *args)
    assert F.canonical(device.launches, F.tensors_of(args) + F.tensors_of(out)) == F.canonical(
        jit.launches, F.tensors_of(args) + F.tensors_of(want))


def test_a_held_tensor_is_an_address_and_replacing_it_forgets_the_decisions(device):
    from rlk_core.ops.rope import triton as rope

    rope.reserve(CPU, 64, 12345.0, 100)
    x, pos = _rand(3, 4, 64), torch.arange(3)
    assert _cuda.OPS["rope"].supports(x, pos, 12345.0, 64)[0]
    packed = _cuda.OPS["rope"].decision((x, pos, 12345.0, 64)).packed
    assert packed is not None
    device.clear()
    _cuda.OPS["rope"].run(x, pos, 12345.0, 64)
    (_, _, args), = device.launches
    assert args[2] == (("address", rope.reserved_tables(CPU, 64, 12345.0)[0].data_ptr()), 0)
    rope.reserve(CPU, 64, 12345.0, 10000)  # a longer table replaces it
    assert not _cuda._DECISIONS
    assert _cuda.OPS["rope"].decision((x, pos, 12345.0, 64)).packed != packed


def _words(op, args):
    from array import array

    return list(array("q", _cuda.OPS[op].decision(args).packed))


def test_a_program_record_is_buffers_launches_and_outputs(device):
    """The record of a TMA GEMM: its output buffer, one launch whose descriptors are over input 0 and buffer 0 with
    their shapes and row strides, the integers M, N, K, and the output returned alone."""
    x, w = _rand(256, 1024), _rand(1536, 1024, seed=2)
    words = _words("linear", (x, w, None))
    assert words[:7] == [0, 1, _cuda.SCALAR_TYPES[torch.bfloat16], 0, 2, 256, 1536]  # device, 1 buffer [256, 1536]
    assert words[7] == 1  # one launch: handle, grid, argument count, then seven words per argument
    args = [tuple(words[13 + 7 * i:20 + 7 * i]) for i in range(words[12])]
    assert (_cuda.DESC, _cuda.IN, 0, 0, 256, 1024, 1024) in args
    assert (_cuda.DESC, _cuda.BUF, 0, 0, 256, 1536, 1536) in args
    assert [a[1] for a in args if a[0] == _cuda.INT] == [256, 1536, 1024]
    assert words[-3:] == [1, 0, _cuda.RET_ONE]


def test_a_program_points_into_slices_of_its_buffers(device):
    """token_logprobs over 2 shards: the partials of each shard are written at byte offsets into the [T, 8, P]
    buffers (pointers into a buffer), and the op returns two buffers (logp, lse)."""
    logits = _rand(5, 32000)
    words = _words("token_logprobs", (list(logits.split(16000, 1)), torch.arange(5), torch.ones(5)))
    kinds = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    assert any(k[0] == _cuda.BUF and k[2] > 0 for k in kinds)
    assert words[-1] == _cuda.RET_TUPLE and words[-4] == 2
