"""The ops' fast path (``rlk_core.ops._dispatch``: ``_C.fast``) on the CPU: what a call served by ``rlk.cuda`` teaches,
when a repeat takes the fast path and when it must not, and that a fast call launches what the Python path launches
and is counted where the Python path counts it. ``_C`` is :class:`_cuda_fakes.Recorder`, whose ``fast*`` functions
follow ``csrc/rlk_cuda.cpp``'s; ``rlk.cuda`` is registered for CPU tensors, which stand for a device's. The C++
itself runs in ``tests/gpu/test_fast_path_gpu.py``."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from rlk_core import ops
from rlk_core.aot import specs as S
from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops import _dispatch as D
from rlk_core.readback import ReadbackRecorder
from rlk_core.routes import RoutePlan

pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cuda_fakes as F

rms = importlib.import_module("rlk_core.ops.rms_norm.cuda")
sw = importlib.import_module("rlk_core.ops.swiglu.cuda")
rp = importlib.import_module("rlk_core.ops.rope.cuda")
rpt = importlib.import_module("rlk_core.ops.rope.triton")

OPS = {"swiglu": (sw, "forward", "supports"), "rms_norm": (rms, "forward", "supports"),
       "rms_norm_backward": (rms, "backward", "supports_backward"), "rope": (rp, "forward", "supports")}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aot")
    F.write_manifest(folder, S.enumerate_specs(("rms_norm", "swiglu", "rope", "rms_norm_backward"), (torch.bfloat16,)))
    return folder


@pytest.fixture
def ext(manifest, monkeypatch):
    """The fake device, with ``rlk.cuda`` registered for CPU tensors (the builtin one put back afterwards)."""
    with F.fake_device(monkeypatch, manifest, rms, sw, rp) as (recorder, _):
        builtin = {op: REGISTRY.get(op, cc.BACKEND_ID) for op in OPS}
        for op, (module, fn, supports) in OPS.items():
            REGISTRY.register(Backend(cc.BACKEND_ID, op, getattr(module, fn), devices=("cpu",), priority=100,
                                      supports=getattr(module, supports), builtin=True), replace=True)
        try:
            cc.extension()  # as the first rlk.cuda launch would: the fast path set up
            assert D._FAST[0] is not None
            yield recorder
        finally:
            for backend in builtin.values():
                REGISTRY.register(backend, replace=True)


def _recorder():
    return ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"))


def _count(rec, module, op):
    return rec.to_dict()["modules"][module]["ops"][op]["call_count"]


def _x(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_a_repeat_runs_on_the_fast_path_with_the_python_path_s_launch_and_count(ext):
    x = _x(64, 2048)
    rec = _recorder()
    with rec.scope("ffn"):
        outs = [ops.swiglu(x) for _ in range(3)]
    assert ext.via == ["run", "fast", "fast"]  # the first call taught it (and the scope's record)
    assert ext.fast_entries() == 1
    assert _count(rec, "ffn", "swiglu") == 3
    (h0, g0, a0), *rest = ext.calls
    for (h, g, a), y in zip(rest, outs[1:], strict=True):
        assert (h, g) == (h0, g0) and a[0] is x and [v for v in a[2:]] == a0[2:]  # same variant, grid, sizes
        assert a[1] is not a0[1] and a[1].shape == a0[1].shape  # a fresh output, as the Python path allocates
        assert y.shape == (64, 1024) and y.dtype == x.dtype


def test_each_scope_and_execution_context_is_taught_before_it_is_used(ext):
    x = _x(32, 512)
    ops.swiglu(x)
    assert ext.via == ["run"]
    ops.swiglu(x)  # no scope active: nothing to count
    assert ext.via[-1] == "fast"
    first, second = _recorder(), _recorder()
    with first.scope("ffn"):
        ops.swiglu(x), ops.swiglu(x)
    with second.scope("ffn"):
        ops.swiglu(x)
    assert ext.via[2:] == ["run", "fast", "run"]
    assert _count(first, "ffn", "swiglu") == 2 and _count(second, "ffn", "swiglu") == 1


def test_what_the_fast_path_refuses_takes_the_python_path(ext, monkeypatch):
    x = _x(16, 256)
    ops.swiglu(x)
    ops.swiglu(x)
    assert ext.via == ["run", "fast"]
    ext.clear()
    ops.swiglu(_x(17, 256))  # another signature: taught now
    ops.swiglu(x[:, :128].contiguous()[:, :128])
    assert ext.via[0] == "run"
    ext.clear()
    monkeypatch.setenv("RLK_VALUE_CHECKS", "always")
    ops.swiglu(x)
    monkeypatch.delenv("RLK_VALUE_CHECKS")
    assert ext.via == ["run"]

    class Sub(torch.Tensor):
        pass

    ext.clear()
    with torch.inference_mode():
        ops.swiglu(x)  # x is no inference tensor: its key set is known
        xi = x.clone()  # one is: another dispatch key set, taught on its own
        ops.swiglu(xi), ops.swiglu(xi)
    assert ext.via == ["fast", "run", "fast"]
    ext.clear()
    ops.swiglu(x.as_subclass(Sub))
    assert ext.via == ["run"]


def test_a_call_that_needs_autograd_runs_its_function_whose_forward_takes_the_fast_path(ext):
    x = _x(8, 64).requires_grad_()
    ops.swiglu(x.detach())
    y = ops.swiglu(x)
    assert y.grad_fn is not None
    assert ext.via == ["run", "fast"]  # inside the Function's forward grad mode is off: the taught call


def test_registry_changes_and_clear_records_forget_everything(ext):
    x = _x(8, 64)
    ops.swiglu(x), ops.swiglu(x)
    assert ext.fast_entries() == 1
    REGISTRY.refresh()
    assert ext.fast_entries() == 0
    ops.swiglu(x), ops.swiglu(x)
    cc.clear_records()
    assert ext.fast_entries() == 0
    assert D.fast_path(False) is True
    ops.swiglu(x), ops.swiglu(x)
    assert ext.via == ["run", "fast", "run", "fast", "run", "run"]
    D.fast_path(True)


def test_a_program_op_returns_its_tuple_from_the_fast_path(ext):
    x, w = _x(64, 1024), _x(1024, seed=1)
    g = _x(64, 1024, seed=2)
    outs = [D.call("rms_norm_backward", g, x, w, 1e-6) for _ in range(2)]
    assert ext.via[-2:] == ["run_program", "fast"] and len(ext.via) == 4  # two launches per call
    assert all(type(o) is tuple and len(o) == 2 for o in outs)
    assert [t.shape for t in outs[1]] == [x.shape, w.shape]


def test_rope_holds_a_reserved_table_until_it_is_replaced(ext, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has none
    x = _x(16, 8, 128)
    pos = torch.arange(16)
    ops.rope(x, pos, 1e6, 128), ops.rope(x, pos, 1e6, 128)  # a table sized from the positions: not held
    assert ext.via == ["run", "run"] and ext.fast_entries() == 0
    rpt.reserve(torch.device("cpu"), 128, 1e6, 8192)  # replaces the 4096-row table (reserve_tables: CUDA only)
    ext.clear()
    ops.rope(x, pos, 1e6, 128), ops.rope(x, pos, 1e6, 128)
    assert ext.via == ["run", "fast"]
    cos = rpt.reserved_tables(torch.device("cpu"), 128, 1e6)[0]
    assert any(a is cos for a in ext.calls[1][2])  # the fast call reads the reserved table itself
    rpt.reserve(torch.device("cpu"), 128, 1e6, 20000)
    assert ext.fast_entries() == 0
    rpt._TABLES.clear(), rpt._RESERVED.clear()


# -- lesson(): what one backend call may teach ---------------------------------------------------------------
def _seen(inputs, result, program=False, no_output=False):
    return [(program, b"packed", tuple(inputs), result, no_output)]


def test_lesson_maps_arguments_transposes_stable_tensors_and_constants():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    y = torch.empty(4, 6)
    got = cc.lesson((x, w, None), y, _seen([x, w, x.t(), w.t(), None, 3, 0.5], y))
    assert got == (False, b"packed", [0, 1, cc.TRANSPOSED, cc.TRANSPOSED + 1, 2, -1, -2], (3, 0.5), 0)
    table = torch.randn(4)
    cc.keep_stable(table)
    assert cc.lesson((x,), y, _seen([x, table], y))[2:4] == ([0, -1], (table,))
    pair = (y, torch.empty(2))
    assert cc.lesson((x,), pair[0], _seen([x], pair, program=True))[4] == 1
    assert cc.lesson((x, w), None, _seen([x, w], None, no_output=True))[4] == 0


def test_lesson_refuses_what_it_cannot_repeat():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    y = torch.empty(4, 6)
    assert cc.lesson((x, w), y, _seen([x.contiguous().clone(), w], y)) is None  # a copy the backend made
    assert cc.lesson((x, w), y, _seen([x, w], y) + _seen([x, w], y)) is None  # two records
    assert cc.lesson((x, w), y, _seen([x, w], y) + [None]) is None  # another launch, or an op inside
    assert cc.lesson((x, w), y, _seen([x, w], None)) is None  # the allocation was misaligned: nothing ran
    assert cc.lesson((x, w), y.view(-1), _seen([x, w], y)) is None  # the backend changed the result
    assert cc.lesson((x, w), y, _seen([x, w, "text"], y)) is None
    assert cc.lesson((x, w), y, _seen([x, w[:, :4].t()], y)) is None  # not the .t() of an argument


@pytest.fixture
def logp_ext(tmp_path, monkeypatch):
    """The fake device with rlk.cuda's ``logp_partials`` and ``merge_logp_partials`` for CPU tensors."""
    tlc = importlib.import_module("rlk_core.ops.token_logprobs.cuda")
    F.write_manifest(tmp_path, S.enumerate_specs(("logp",), (torch.bfloat16,)))
    with F.fake_device(monkeypatch, tmp_path, tlc) as (recorder, _):
        pairs = {"logp_partials": (tlc.logp_partials, tlc.supports_logp_partials),
                 "merge_logp_partials": (tlc.merge_logp_partials, tlc.supports_merge_logp_partials)}
        builtin = {op: REGISTRY.get(op, cc.BACKEND_ID) for op in pairs}
        for op, (fn, supports) in pairs.items():
            REGISTRY.register(Backend(cc.BACKEND_ID, op, fn, devices=("cpu",), priority=100, supports=supports,
                                      builtin=True), replace=True)
        try:
            cc.extension()
            yield recorder
        finally:
            for backend in builtin.values():
                REGISTRY.register(backend, replace=True)


def test_the_vocab_parallel_log_prob_halves_repeat_on_the_fast_path(logp_ext):
    """``logp_partials`` and ``merge_logp_partials`` (custom ops run directly): the first call of a signature runs
    rlk.cuda's program and teaches it, a repeat is one fast call with the same launches and fresh outputs of the
    same shapes; another ``vocab_start`` (a scalar in the signature) is not the taught call."""
    t, vocab = 5, 8192  # half a vocabulary of 8 groups of 4 padded leaf blocks: a served stride class
    shard = _x(t, vocab // 2)
    target = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(3))
    temp = torch.full((t,), 0.7)
    first = ops.logp_partials(shard, target, temp, 0, vocab)
    n = len(logp_ext.via)
    assert logp_ext.via == ["run_program"] * n and n >= 1
    again = ops.logp_partials(shard, target, temp, 0, vocab)
    assert logp_ext.via[n:] == ["run_program"] * (n - 1) + ["fast"]
    assert [(h, g) for h, g, _ in logp_ext.calls[n:]] == [(h, g) for h, g, _ in logp_ext.calls[:n]]
    assert [x.shape for x in again] == [x.shape for x in first] and again[0] is not first[0]
    logp_ext.clear()
    ops.logp_partials(shard, target, temp, vocab // 2, vocab)  # the other half: taught on its own
    assert logp_ext.via[-1] == "run_program"
    logp_ext.clear()
    m, s = torch.randn(t, 8), torch.rand(t, 8) + 1.0
    zt = torch.randn(t)
    ops.merge_logp_partials(m, s, zt, vocab), ops.merge_logp_partials(m, s, zt, vocab)
    assert logp_ext.via[-1] == "fast" and logp_ext.via[0] == "run_program"
    assert logp_ext.fast_entries() == 3
