"""Shapes and input builders shared by the GPU tests and benchmarks/ (one source of truth).

Qwen3-8B: hidden 4096, 32 q heads, 8 kv heads, head dim 128, intermediate 12288, vocab 151936.
Qwen3-0.6B: hidden 1024, 16 q heads, 8 kv heads, head dim 128, intermediate 3072, vocab 151936.
Tensor-parallel shards divide N (column-parallel) or K (row-parallel) by TP.
"""

from __future__ import annotations

import torch

M_LIST = (1, 2, 3, 7, 16, 63, 64, 65, 127, 128, 1000, 4096, 8192)

# the backends the registry may pick for an rlk op on the GPU: rlk.cuda where the build has its binary, rlk.triton
# otherwise (same contract, same bits: tests/gpu/test_cuda_backend_gpu.py compares them variant by variant)
RLK_GPU = ("rlk.cuda", "rlk.triton")

MODELS = {
    "qwen3-8b": {"hidden": 4096, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "inter": 12288, "vocab": 151936},
    "qwen3-0.6b": {"hidden": 1024, "q_heads": 16, "kv_heads": 8, "head_dim": 128, "inter": 3072, "vocab": 151936},
}
TP_LIST = (1, 2, 4)


def linear_shapes() -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of every projection of both models at TP 1, 2, 4."""
    out = []
    for model, c in MODELS.items():
        h, d = c["hidden"], c["head_dim"]
        for tp in TP_LIST:
            qkv = (c["q_heads"] + 2 * c["kv_heads"]) * d // tp
            out += [
                (f"{model}/tp{tp}/qkv", qkv, h),
                (f"{model}/tp{tp}/o", h, c["q_heads"] * d // tp),
                (f"{model}/tp{tp}/gate_up", 2 * c["inter"] // tp, h),
                (f"{model}/tp{tp}/down", h, c["inter"] // tp),
                (f"{model}/tp{tp}/lm_head", c["vocab"] // tp, h),
            ]
    return out


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(shape, dtype=torch.bfloat16, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Random normal data on the GPU (never zeros: zeros hide unwritten outputs)."""
    return (torch.randn(shape, device="cuda", generator=gen(seed), dtype=torch.float32) * scale).to(dtype)


def linear_inputs(m: int, n: int, k: int, dtype=torch.bfloat16, seed: int = 0):
    x = randn((m, k), dtype, 1.0, seed)
    w = randn((n, k), dtype, k ** -0.5, seed + 1)  # outputs of order 1, as in a trained layer
    return x, w


def assert_close_dot(out, ref, absdot, dtype, name):
    """``|out - ref| <= atol + rtol * max(|ref|, sum_k |x_k w_k|)`` with (rtol, atol) from ``dtype_tols``.

    Two fp32 accumulation orders of one dot product (the kernel's sequential K loop, the reference's
    pairwise tree) differ by up to about ``sqrt(K) * eps * sum_k |x_k w_k|`` (Higham's bound), which
    for results near zero is far above ``rtol * |ref|``; scaling by the sum of absolute products is the
    condition-aware form of the same tolerance.
    """
    from rlk_core.testing import dtype_tols

    tols = dtype_tols(dtype)
    allowed = tols["atol"] + tols["rtol"] * torch.maximum(ref.double().abs(), absdot.double())
    err = (out.double() - ref.double()).abs()
    bad = err > allowed
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} of {err.numel()} elements outside tolerance; "
                                 f"worst error / allowed {float((err / allowed).max()):.3g}")
