"""Driver for compute-sanitizer: runs every rlk.triton kernel once at small, awkward shapes.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck  python tests/gpu/sanitize_kernels.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python tests/gpu/sanitize_kernels.py [PART ...]

PART: ``linear``, ``rowwise`` (rms_norm, swiglu, rope) or a module of ``SANITIZE_MODULES``; default all.

Not a pytest module (no ``test_`` prefix): the sanitizer wraps the whole process. Exits non-zero if
a result is wrong, so a run that silently computed garbage cannot look clean.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch

from rlk_core.ops._plan import jit_plan
from rlk_core.ops.linear import triton as linear_t
from rlk_core.ops.linear.reference import linear_reference
from rlk_core.ops.rms_norm import triton as rms_t
from rlk_core.ops.rms_norm.reference import rms_norm_reference
from rlk_core.ops.rope import triton as rope_t
from rlk_core.ops.rope.reference import rope_reference
from rlk_core.ops.swiglu import triton as swiglu_t
from rlk_core.ops.swiglu.reference import swiglu_reference
from rlk_core.testing import dtype_tols

# GPU test modules that define sanitize_cases() for their kernels (attention, log-probs)
SANITIZE_MODULES = ("test_attention_gpu", "test_attention_backward_gpu", "test_logprobs_gpu")


def close(a, b, dtype, what):
    torch.testing.assert_close(a.double(), b.double(), **dtype_tols(dtype), msg=lambda m: f"{what}: {m}")


def main(parts: list[str]) -> int:
    unknown = set(parts) - {"linear", "rowwise", *SANITIZE_MODULES}
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}")
    parts = parts or ["linear", "rowwise", *SANITIZE_MODULES]
    torch.manual_seed(0)
    if "linear" in parts:
        _linear()
    if "rowwise" in parts:
        _rowwise()
    torch.cuda.synchronize()
    # the test modules use relative imports (._shapes): load them as a package named after this folder
    pkg = types.ModuleType("rlk_gpu_tests")
    pkg.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["rlk_gpu_tests"] = pkg
    for name in SANITIZE_MODULES:
        if name in parts:
            importlib.import_module(f"rlk_gpu_tests.{name}").sanitize_cases()
            torch.cuda.synchronize()
            print(f"sanitize_kernels: {name}.sanitize_cases() ran and matched")
    print(f"sanitize_kernels: {', '.join(parts)}: all kernels ran and matched the reference")
    return 0


def _linear() -> None:
    dev = "cuda"
    P = jit_plan(torch.device(dev))
    # pointer kernel at 16/64/128-row tiles (N = 130, 257: rows not 16-byte aligned, no TMA) and the TMA
    # kernels: 64-row tiles (M = 70, last row block by a 16-row box) and the persistent 128-row tiles
    # (M = 300), ragged N and K
    for dt in (torch.bfloat16, torch.float32):
        for m, n, k in ((1, 64, 64), (65, 130, 200), (3, 257, 128), (70, 96, 128), (300, 264, 136), (200, 130, 72)):
            x = torch.randn(m, k, device=dev).to(dt)
            w = (torch.randn(n, k, device=dev) * k ** -0.5).to(dt)
            b = torch.randn(n, device=dev).to(dt)
            close(linear_t.forward(P, x, w, b), linear_reference(x, w, b), dt, f"linear {m}x{n}x{k}")
            close(linear_t.forward(P, x.t().contiguous().t(), w.t().contiguous().t(), None),
                  linear_reference(x, w, None), dt, "linear strided")
    # the TMA kernel with a 16-row tail (64 < M <= 80 on large weights: full and ragged tails), and 64-row
    # tiles whose last row block is read with a 32-row box (M = 90, 20) or a 16-row box (M = 65)
    for tile, ms in (((64, 32, 64, 8, 4, 3, 16), (80, 70, 65, 161)), ((64, 32, 64, 8, 4, 3), (90, 20, 65))):
        cfg = linear_t.tile_config(tile, 136, torch.bfloat16, True)
        for m in ms:
            x = torch.randn(m, 136, device=dev).to(torch.bfloat16)
            w = (torch.randn(72, 136, device=dev) * 136 ** -0.5).to(torch.bfloat16)
            b = torch.randn(72, device=dev).to(torch.bfloat16)
            close(linear_t.linear_2d(x, w, b, cfg), linear_reference(x, w, b), torch.bfloat16, f"linear {tile} M={m}")
    # a row split into two launches (128 rows by 128x256 tiles, 160 by 128x64 tiles)
    x = torch.randn(288, 136, device=dev).to(torch.bfloat16)
    w = (torch.randn(264, 136, device=dev) * 136 ** -0.5).to(torch.bfloat16)
    cfg = dict(linear_t.tile_config((128, 256, 64, 8, 8, 3), 136, torch.bfloat16, True), SPLIT_ROWS=128,
               REST=linear_t.tile_config((128, 64, 128, 8, 8, 4), 136, torch.bfloat16, True))
    close(linear_t.linear_2d(x, w, None, cfg), linear_reference(x, w, None), torch.bfloat16, "linear split")


def _rowwise() -> None:
    dev = "cuda"
    P = jit_plan(torch.device(dev))
    for dt in (torch.bfloat16, torch.float32):
        for shape in ((5, 128), (3, 1000), (17, 4096)):
            x, wt = torch.randn(shape, device=dev).to(dt), torch.randn(shape[-1], device=dev).to(dt)
            close(rms_t.forward(P, x, wt, 1e-6), rms_norm_reference(x, wt, 1e-6), dt, f"rms_norm {shape}")
        for shape in ((5, 2 * 768), (3, 2 * 100), (2, 2 * 3072)):
            x = torch.randn(shape, device=dev).to(dt)
            close(swiglu_t.forward(P, x), swiglu_reference(x), dt, f"swiglu {shape}")
        for t, h, d, rd in ((5, 8, 128, 128), (3, 3, 96, 64)):
            x = torch.randn(t, h, d, device=dev).to(dt)
            pos = torch.randint(0, 5000, (t,), device=dev)
            close(rope_t.forward(P, x, pos, 1e6, rd), rope_reference(x, pos, 1e6, rd), dt, f"rope {t, h, d, rd}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
