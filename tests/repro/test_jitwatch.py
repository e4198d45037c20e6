"""rlk_repro.jitwatch: a real Triton compile (sm_90, on the CPU, as the AOT build compiles) is recorded in the
phase it ran in, a second one from Triton's disk cache as a load; the listener found is chained and restored."""

from __future__ import annotations

import pytest

from rlk_repro.jitwatch import JitWatch, counts

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _jitwatch_probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def _compile(block: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(_jitwatch_probe_kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": block})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))


def test_compiles_and_cache_loads_are_counted_per_phase(tmp_path):
    seen = []
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(tmp_path)
        triton.knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
        watch = JitWatch()
        assert watch.available
        with watch.phase("train"):
            _compile(64)
        with watch.phase("rollout"):
            _compile(64)  # the same variant again: Triton's disk cache
        _compile(128)  # outside any phase: "setup"
        got = watch.take()
        watch.close()
        assert triton.knobs.compilation.listener is not None and seen == [False, True, False]  # chained
        _compile(256)
        assert seen == [False, True, False, False]  # the previous listener is back, alone
    assert counts(got, "train") == (1, 0) and counts(got, "rollout") == (0, 1) and counts(got, "setup") == (1, 0)
    assert got["train"]["compiled_kernels"] == ["_jitwatch_probe_kernel[BLOCK=64]"]
    assert got["rollout"]["loaded_kernels"] == ["_jitwatch_probe_kernel[BLOCK=64]"]
    assert got["setup"]["compiled_kernels"] == ["_jitwatch_probe_kernel[BLOCK=128]"]
    assert got["train"]["compile_s"] > 0
    assert watch.take() == {}  # taken once
    assert counts(None, "train") == (0, 0) and counts({}, "rollout") == (0, 0)


def test_a_round_without_compiles_records_nothing(tmp_path):
    with triton.knobs.compilation.scope():
        watch = JitWatch()
        with watch.phase("rollout"):
            pass
        assert watch.take() == {}
        watch.close()
        assert triton.knobs.compilation.listener is None
