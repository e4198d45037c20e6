"""Shared plumbing of rlk's Triton backends (``rlk.triton``): probe, lazy loading, small helpers.

Importing this module imports neither Triton nor touches CUDA: each op's ``ops/<op>/triton.py``
(which does import Triton at its top) is loaded on the first call that needs it, after
:func:`available` said Triton and a suitable GPU are there.

The invariant every kernel of this backend keeps: each output element is reduced in one fixed order —
a reduction dimension (K, the row, the KV positions, the vocab blocks) walked in fixed blocks in
increasing order, accumulated in fp32, rounded once — and that order does not depend on the number of
rows. What may vary with the rows is which program computes an element: the GEMM picks its tile over M
and N per call for speed (:mod:`rlk_core.ops.linear.tiles`), which changes the tile shape, the MMA
instruction family and the load path but not the K loop. That every such tile gives the same bits is a
property of the GPU, not of the source, so the contract suite (``rlk_core.testing.contracts``, run by
``rlk-selfcheck`` and the GPU tests) checks it on each GPU. No autotuning, no split-K, no atomics; the row
count is passed with ``do_not_specialize``, so M does not multiply the compiled variants.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from rlk_core.backends import Backend

BACKEND_ID = "rlk.triton"
PRIORITY = 10
MIN_CAPABILITY = (8, 0)  # bf16 tensor-core dot; validated on sm_90 (H200)


def available() -> tuple[bool, str]:
    """``(ok, reason)``: Triton importable, a CUDA device of compute capability >= 8.0.

    ROCm builds of torch report ``torch.version.hip``; the kernels avoid CUDA-only features (see
    docs/ops/gpu-kernels.md) but are not validated there, so the probe says no rather than guess.
    """
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return False, f"triton is not importable: {exc}"
    import torch

    if getattr(torch.version, "hip", None):
        return False, "ROCm/HIP device: rlk.triton kernels are not validated on ROCm yet"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return False, f"compute capability {cap} < {MIN_CAPABILITY}"
    return True, f"triton on compute capability {cap}"


@functools.cache
def has_tma(index: int) -> bool:
    """Whether CUDA device ``index`` has TMA (NVIDIA sm_90+; ROCm reports gfx9xx as capability 9.x and
    has none). The TMA load paths of the GEMM and the attention kernels are taken only where it does."""
    import torch

    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    cache: list[Callable[..., Any]] = []

    def call(*args: Any) -> Any:
        if not cache:
            cache.append(getattr(importlib.import_module(module), attr))
        return cache[0](*args)

    call.__name__ = f"{module}.{attr}"
    return call


def triton_backend(op: str, module: str | None = None, fn: str = "forward", supports: str = "supports") -> Backend:
    """The ``rlk.triton`` :class:`Backend` of ``op``. Its module (default ``rlk_core.ops.<op>.triton``)
    must define ``fn(*args)`` (the op's signature) and ``supports(*args) -> (ok, reason)``; ops that
    share a module (the attention family) name their own functions."""
    module = module or f"rlk_core.ops.{op}.triton"
    return Backend(
        id=BACKEND_ID,
        op=op,
        fn=_lazy(module, fn),
        devices=("cuda",),
        priority=PRIORITY,
        available=available,
        supports=_lazy(module, supports),
        builtin=True,
    )
