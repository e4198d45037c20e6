"""The kernel backends of an op, both from its launch plan: ``rlk.triton`` (the plan run by Triton's JIT) and
``rlk.cuda`` (the same plan served by the AOT cubins) — one line per op in its ``__init__``."""

from __future__ import annotations

from rlk_core.backends import REGISTRY
from rlk_core.ops._cuda import cuda_backend
from rlk_core.ops._plan import triton_backend


def register_kernel_backends(op: str, plan: str, supports: str | None = None) -> None:
    """Register ``rlk.triton`` and ``rlk.cuda`` for ``op``: ``plan`` and ``supports`` are ``"module:function"`` of its
    Triton module (imported on first use: importing it imports Triton)."""
    REGISTRY.register(triton_backend(op, plan, supports))
    REGISTRY.register(cuda_backend(op, plan, supports))
