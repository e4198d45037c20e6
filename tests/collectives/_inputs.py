"""Input builders shared by the collective tests (gloo and NCCL workers) and benchmarks/bench_collectives.py.

Every rank builds the contributions of *all* ranks from one seed, so each rank (and the test process)
can compute the reference ``tree_sum_fp32`` without communicating.
"""

from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def smallest_subnormal(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def adversarial(world: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """``world`` CPU tensors ``[n]`` of ``dtype``, one per rank, built to make the order of addition show.

    Element classes, cycled through by index: mixed exponents (normal values scaled by ``2**e``,
    ``e`` in ``[-24, 24]``), near-cancellation (rank 1 holds ``-x_0`` plus a small term), signed zeros
    (all ``-0``, or a mix of ``+0`` / ``-0``), subnormals of ``dtype``, values near the dtype's maximum
    (sums overflow), and, at a few fixed indices, ``+inf``, ``-inf`` on another rank (``inf - inf`` is
    NaN) and NaN.
    """
    g = torch.Generator().manual_seed(seed * 1000 + world)
    fi = torch.finfo(dtype)
    base = torch.randn(world, n, generator=g, dtype=torch.float64)
    exps = torch.randint(-24, 25, (world, n), generator=g).double()
    x = base * torch.exp2(exps)
    cls = torch.arange(n) % 8
    small = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    if world > 1:
        x[1, cls == 1] = -x[0, cls == 1] * (1 + small[cls == 1])
    x[:, cls == 2] = -0.0
    mix = torch.randint(0, 2, (world, n), generator=g).bool()
    x[:, cls == 3] = torch.where(mix[:, cls == 3], 0.0, -0.0).double()
    sub = smallest_subnormal(dtype)
    steps = torch.randint(-3, 4, (world, n), generator=g).double()
    x[:, cls == 4] = (steps * sub)[:, cls == 4]
    x[:, cls == 5] = (torch.rand(world, n, generator=g, dtype=torch.float64) * 0.5 + 0.5)[:, cls == 5] * fi.max
    out = x.clamp(-fi.max, fi.max).to(dtype)
    if n > 16:
        out[0, 7] = float("inf")
        out[world - 1, 15] = float("-inf") if world > 1 else float("nan")
        out[0, 15] = float("inf")
        out[world // 2, 6] = float("nan")
    return list(out)


def random_bits(world: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Uniformly random bit patterns (every exponent, NaN payloads and infinities included)."""
    g = torch.Generator().manual_seed(seed * 7919 + world)
    info = torch.iinfo(_INT[dtype])
    bits = torch.randint(info.min, info.max, (world, n), generator=g, dtype=torch.int64).to(_INT[dtype])
    return list(bits.view(dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (so NaN payloads and signed zeros compare)."""
    t = t.detach().contiguous().cpu()
    return t.view(_INT[t.dtype]) if t.dtype in _INT else t


def naive_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Left to right in the inputs' dtype, rounding after every add: what a collective may do instead."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = acc + t
    return acc
