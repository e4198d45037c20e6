"""The rlk.triton GEMM kernels under the Triton interpreter (CPU) at tiny shapes: the persistent TMA
kernel and the pointer kernel, several tiles, bias, ragged M/N/K edges — within tolerance of a float64
product. The interpreter does not reproduce GPU bits; bitwise properties are tested in
tests/gpu/test_linear_gpu.py. fp16/fp32 only (the interpreter's bf16 ``tl.dot`` is wrong)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton.runtime.interpreter as interp

    _orig = interp._patch_lang_tensor

    def _patched(tensor, scope):  # numpy >= 2.4: scalars are 1-element arrays, int() needs a 0-d one
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = _patched

    from rlk_core.ops.linear import triton as LT

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        for m, n, k in ((5, 48, 40), (70, 40, 72), (1, 16, 8)):
            x, w, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
            ref = x.double() @ w.double().T + b.double()
            for bm, bn, bk in ((16, 16, 16), (32, 16, 32)):
                for tma in (False, True):
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 2, "num_warps": 4,
                           "num_stages": 2, "EVEN_K": k % bk == 0, "IEEE": dtype == torch.float32, "TMA": tma}
                    err = float((LT.linear_2d(x, w, b, cfg).double() - ref).abs().max())
                    assert err <= tol, (dtype, m, n, k, bm, bn, bk, tma, err)
    print("ok")
""")


def test_linear_triton_kernels_interpreted():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
