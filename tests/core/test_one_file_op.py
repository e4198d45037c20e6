"""Adding a kernel is one file (issue 34): ``_example_op.py`` defines a new op — kernel, plan, build calls, check,
reference, one registration line — and, with no other line anywhere, the AOT build enumerates it as a family,
``rlk.cuda`` serves it from a manifest of that build (launching exactly what ``rlk.triton``'s JIT launches) and
its repeats run on the C++ fast path. On the CPU: the interpreter runs the JIT, ``_cuda_fakes.FakeC`` stands for
the extension (each part in a fresh Python: the example's op stays out of this process's registry)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytest.importorskip("triton")


def test_the_new_op_s_plan_runs_on_the_jit_with_the_reference_s_bits(run_interpreted):
    run_interpreted(f"""
    import sys
    sys.path.insert(0, {HERE!r})
    import _example_op as E

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))  # fp32: the interpreter truncates to bf16
    s = torch.rand(5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(E.forward(CPU, x, s), E.reference(x, s))
    assert torch.equal(E.example_scale_rows(x, s), E.reference(x, s))  # the public op (rlk.reference on the CPU)
    print("ok")
    """)


def test_the_new_op_is_built_served_from_the_manifest_and_replayed_with_no_other_code():
    script = textwrap.dedent(f"""
    import sys, tempfile
    from pathlib import Path
    import pytest, torch
    sys.path.insert(0, {HERE!r})
    import _example_op as E  # before the AOT build is imported: its families are the registered kernel modules
    from rlk_core.aot import build as B
    from rlk_core.backends import REGISTRY
    from rlk_core.ops import _cuda, _plan
    import _cuda_fakes as F

    assert B.FAMILY_OPS["_example_op"] == (E.OP,), B.FAMILY_OPS
    variants = B.enumerate_variants(["_example_op"], ["bf16", "fp32"])
    assert {{v["kernel"] for v in variants}} == {{"_scale_rows_kernel"}} and len(variants) == 14  # 7 blocks x 2 dtypes
    assert {{v["family"] for v in variants}} == {{"_example_op"}}

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    s = torch.rand(5, generator=torch.Generator().manual_seed(1))
    folder = Path(tempfile.mkdtemp())
    F.write_manifest(folder, ["_example_op"], ["bf16"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_plan, "_JIT", {{}})
        with F.fake_device(mp, folder, [E.OP]) as ext:
            assert REGISTRY.select(E.OP, "cpu", (x, s), False).backend.id == _cuda.BACKEND_ID
            outs = [E.example_scale_rows(x, s) for _ in range(3)]
            assert ext.via == ["program", "fast", "fast"], ext.via
            with F.JitLaunches() as jit:
                want = E.forward(_plan.jit_plan(torch.device("cpu")), x, s)
            expect = F.canonical(jit.launches, [x, s, want])
            assert len(expect) == 1 and expect[0][0] == "_scale_rows_kernel", expect
            for i, out in enumerate(outs):
                assert F.canonical(ext.launches[i:i + 1], [x, s, out]) == expect, (i, ext.launches[i], expect)
        # a dtype the build did not compile: declined, saying why (rlk.triton runs it: the same kernels)
        with F.fake_device(mp, folder, [E.OP]) as ext:
            ok, why = _cuda.OPS[E.OP].supports(x.half(), s)
            assert not ok and why, why
            assert REGISTRY.select(E.OP, "cpu", (x.half(), s), False).backend.id != _cuda.BACKEND_ID
    print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=HERE, env=os.environ | {"TRITON_INTERPRET": "0"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]
