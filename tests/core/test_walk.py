"""The walk from the public ``rlk_core.ops.linear(x, w)`` to its kernel, as ``docs/architecture.md`` shows it: the
Python frames on the stack when the launch is made, on the JIT path (rlk.triton: ``JitPlan.launch`` makes
``kernel[grid](...)``) and on the C++ path (rlk.cuda: the first call's ``_C.run_program``, a repeat's ``_C.fast``)
— at most 6 calls in at most 4 files. Recorded on CPU tensors with the backends registered for them (the launch
itself not made)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from rlk_core import ops
from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _cuda, _plan

pytest.importorskip("triton")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cuda_fakes as F

PACKAGE = Path(_plan.__file__).resolve().parents[1]


def _walk() -> list[tuple[str, str]]:
    """``(file relative to rlk_core, function)`` of each frame from the public ``linear`` to the caller's caller."""
    frame, out = sys._getframe(2), []
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        out.append((str(path.relative_to(PACKAGE)) if PACKAGE in path.parents else path.name, frame.f_code.co_name))
        if out[-1] == ("ops/linear/__init__.py", "linear"):
            return out[::-1]
        frame = frame.f_back
    raise AssertionError(f"the public linear is not on the stack: {out}")


def test_the_jit_path_is_six_calls_in_four_files(monkeypatch):
    triton = REGISTRY.get("linear", "rlk.triton")
    monkeypatch.setattr(_plan, "_JIT", {})
    REGISTRY.register(Backend("test.jit-on-cpu", "linear", triton.fn, devices=("cpu",), priority=1 << 20,
                              builtin=True, plan_fn=_plan.resolve_fn(triton.plan)))
    walks = []
    monkeypatch.setattr(_plan.JitPlan, "launch", lambda self, kernel, grid, *a, **k: walks.append(_walk()))
    try:
        ops.linear(torch.randn(4, 64), torch.randn(32, 64))
    finally:
        REGISTRY.unregister("linear", "test.jit-on-cpu")
    (walk,) = walks
    assert walk == [("ops/linear/__init__.py", "linear"), ("ops/_dispatch.py", "__call__"),
                    ("ops/_dispatch.py", "run"), ("ops/linear/triton.py", "forward"),
                    ("ops/linear/triton.py", "_launch")], walk
    # each frame calls the next, the last JitPlan.launch (ops/_plan.py), which calls kernel[grid]
    calls, files = len(walk) + 1, {f for f, _ in walk} | {"ops/_plan.py"}
    assert calls <= 6 and len(files) <= 4


def test_the_cpp_path_is_at_most_four_calls_in_three_files_and_a_repeat_two(tmp_path, monkeypatch):
    F.write_manifest(tmp_path, ("linear",), ("bf16",))
    with F.fake_device(monkeypatch, tmp_path, ("linear",)) as ext:
        walks = []
        run_program = ext.run_program
        monkeypatch.setattr(ext, "run_program", lambda *a, **k: (walks.append(_walk()), run_program(*a, **k))[1])
        fast = ext.fast
        monkeypatch.setattr(ext, "fast", lambda *a: (walks.append(_walk()), fast(*a))[1])
        from rlk_core.ops import _dispatch

        monkeypatch.setattr(_dispatch, "_FAST", [ext.fast])
        x, w = torch.randn(4, 64).bfloat16(), torch.randn(32, 64).bfloat16()
        ops.linear(x, w), ops.linear(x, w)
    first = [w for w in walks if w[-1][1] == "run"]
    repeat = [w for w in walks if w[-1][1] == "__call__"]
    assert first[0] == [("ops/linear/__init__.py", "linear"), ("ops/_dispatch.py", "__call__"),
                        ("ops/_dispatch.py", "run"), ("ops/_cuda.py", "run")], first
    assert repeat[-1] == [("ops/linear/__init__.py", "linear"), ("ops/_dispatch.py", "__call__")], repeat
    assert _cuda.BACKEND_ID == "rlk.cuda"
