"""The ops' fast path (``rlk_core.ops._dispatch``: ``_C.fast``) on the CPU: which calls ``rlk.cuda`` ran as one
program get stored, when a repeat takes the fast path and when it must not, and that a fast call launches what the
Python path launches and is counted where the Python path counts it. ``_C`` is :class:`_cuda_fakes.FakeC`, whose
``fast*`` functions follow ``csrc/rlk_cuda.cpp``'s; ``rlk.cuda`` is registered for CPU tensors, which stand for a
device's. The C++ itself runs in ``tests/gpu/test_fast_path_gpu.py``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from rlk_core import ops
from rlk_core.backends import REGISTRY
from rlk_core.ops import _cuda, _plan
from rlk_core.ops import _dispatch as D
from rlk_core.readback import ReadbackRecorder
from rlk_core.routes import RoutePlan

pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cuda_fakes as F

OPS = ("swiglu", "rms_norm", "rms_norm_backward", "rope", "linear")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aot")
    F.write_manifest(folder, ("swiglu", "rms_norm", "rope", "linear"), ("bf16",))
    return folder


@pytest.fixture
def ext(manifest, monkeypatch):
    with F.fake_device(monkeypatch, manifest, OPS) as fake:
        assert D._FAST[0] is not None
        yield fake


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
    assert ext.via == ["program", "fast", "fast"]  # the first call stored it (and the scope's record)
    assert ext.fast_size() == 1
    assert _count(rec, "ffn", "swiglu") == 3
    (k0, g0, a0), *rest = ext.launches
    for (k, g, a), y in zip(rest, outs[1:], strict=True):
        assert (k, g) == (k0, g0) and a[0][0] is x and a[2:] == a0[2:]  # same variant, grid, sizes
        assert a[1][0] is not a0[1][0] and a[1][0].shape == a0[1][0].shape  # a fresh output, as the Python path's
        assert y.shape == (64, 1024) and y.dtype == x.dtype


def test_each_scope_and_execution_context_is_stored_before_it_is_used(ext):
    x = _x(32, 512)
    ops.swiglu(x)
    assert ext.via == ["program"]
    ops.swiglu(x)  # no scope active: nothing to count
    assert ext.via[-1] == "fast"
    first, second = _recorder(), _recorder()
    with first.scope("ffn"):
        ops.swiglu(x), ops.swiglu(x)
    with second.scope("ffn"):
        ops.swiglu(x)
    assert ext.via[2:] == ["program", "fast", "program"]
    assert _count(first, "ffn", "swiglu") == 2 and _count(second, "ffn", "swiglu") == 1


def test_what_the_fast_path_refuses_takes_the_python_path(ext, monkeypatch):
    x = _x(16, 256)
    ops.swiglu(x), ops.swiglu(x)
    assert ext.via == ["program", "fast"]
    ext.clear()
    ops.swiglu(_x(17, 256))  # another signature: stored now
    assert ext.via == ["program"]
    ext.clear()
    monkeypatch.setenv("RLK_VALUE_CHECKS", "always")
    ops.swiglu(x)
    monkeypatch.delenv("RLK_VALUE_CHECKS")
    assert ext.via == ["program"]

    class Sub(torch.Tensor):
        pass

    ext.clear()
    ops.swiglu(x.as_subclass(Sub))
    assert ext.via == ["program"]
    ext.clear()
    x.requires_grad_()
    y = ops.swiglu(x)  # autograd: its Function, whose forward (grad mode off) takes the stored call
    assert y.grad_fn is not None and ext.via == ["fast"]


def test_registry_changes_and_invalidate_forget_everything(ext):
    x = _x(8, 64)
    ops.swiglu(x), ops.swiglu(x)
    assert ext.fast_size() == 1
    REGISTRY.refresh()
    assert ext.fast_size() == 0 and not _cuda._DECISIONS
    ops.swiglu(x), ops.swiglu(x)
    _plan.invalidate()
    assert ext.fast_size() == 0
    assert D.fast_path(False) is True
    ops.swiglu(x), ops.swiglu(x)
    assert ext.via == ["program", "fast", "program", "fast", "program", "program"]
    D.fast_path(True)


def test_an_op_of_two_outputs_returns_its_tuple_from_the_fast_path(ext):
    x, w, g = _x(64, 1024), _x(1024, seed=1), _x(64, 1024, seed=2)
    outs = [D.op("rms_norm_backward")(g, x, w, 1e-6) for _ in range(2)]
    assert ext.via == ["program", "program", "fast", "fast"]  # two launches per call
    assert all(type(o) is tuple and len(o) == 2 for o in outs)
    assert [t.shape for t in outs[1]] == [x.shape, w.shape]


def test_a_linear_with_leading_dims_and_transposed_operands_repeats_its_program(ext):
    x, w = _x(2, 3, 1024), _x(256, 1024, seed=1)
    a, b = ops.linear(x, w), ops.linear(x, w)
    assert ext.via == ["program", "fast"] and a.shape == b.shape == (2, 3, 256)
    g = _x(6, 256)
    ext.clear()
    D.op("linear")(g.t(), x.reshape(6, 1024).t(), None), D.op("linear")(g.t(), x.reshape(6, 1024).t(), None)
    assert ext.via == ["program", "fast"]  # the backward's dW: views of the arguments, no copy


def test_rope_holds_a_reserved_table_until_it_is_replaced(ext):
    from rlk_core.ops.rope import triton as rpt

    x, pos = _x(16, 8, 128), torch.arange(16)
    ops.rope(x, pos, 7e5, 128), ops.rope(x, pos, 7e5, 128)  # a table sized from the positions: not held
    assert ext.via == ["launch", "launch"] and ext.fast_size() == 0
    rpt.reserve(torch.device("cpu"), 128, 7e5, 8192)  # replaces the 4096-row table (reserve_tables: CUDA only)
    ext.clear()
    ops.rope(x, pos, 7e5, 128), ops.rope(x, pos, 7e5, 128)
    assert ext.via == ["program", "fast"]
    cos = rpt.reserved_tables(torch.device("cpu"), 128, 7e5)[0]
    assert ext.launches[1][2][2] == (("address", cos.data_ptr()), 0)  # the fast call reads the reserved table
    rpt.reserve(torch.device("cpu"), 128, 7e5, 20000)
    assert ext.fast_size() == 0
