"""The kernel backends of an op, both from its launch plan: ``rlk.triton`` (the plan run by Triton's JIT) and
``rlk.cuda`` (the same plan served by the AOT cubins) — one line per op in its ``__init__``."""

from __future__ import annotations

from rlk_core.backends import REGISTRY
from rlk_core.ops._cuda import cuda_backend
from rlk_core.ops._plan import triton_backend

# the Triton module each op's plan lives in -> its ops, in registration order: the AOT build's families
# (rlk_core.aot.build compiles each module's build_calls), so an op registered here is built and served with no
# other line anywhere
KERNEL_MODULES: dict[str, list[str]] = {}


def register_kernel_backends(op: str, plan: str, supports: str | None = None) -> None:
    """Register ``rlk.triton`` and ``rlk.cuda`` for ``op``: ``plan`` and ``supports`` are ``"module:function"`` of its
    Triton module (imported on first use: importing it imports Triton), which the AOT build then compiles."""
    REGISTRY.register(triton_backend(op, plan, supports))
    REGISTRY.register(cuda_backend(op, plan, supports))
    KERNEL_MODULES.setdefault(plan.partition(":")[0], []).append(op)
