"""Input validation shared by the ops: every failure names the op, the argument and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlk_core import _compat as compat
from rlk_core import envs
from rlk_core.errors import RlkInputError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)


def require(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise RlkInputError(f"rlk.{op}: {message}")


def float_tensor(t: torch.Tensor, op: str, name: str) -> None:
    if isinstance(t, torch.Tensor) and t.dtype in FLOAT_DTYPES:
        return
    require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor, got {type(t).__name__}")
    require(False, op, f"{name} has dtype {t.dtype}; allowed: float32, bfloat16, float16")


def int_tensor(t: torch.Tensor, op: str, name: str) -> None:
    if isinstance(t, torch.Tensor) and t.dtype in INT_DTYPES:
        return
    require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor, got {type(t).__name__}")
    require(False, op, f"{name} has dtype {t.dtype}; allowed: int32, int64")


def _one(tensors: dict[str, torch.Tensor | None], attr: str) -> bool:
    """Whether the tensors (None skipped) agree on ``attr`` (the check per call; the message only on failure)."""
    first = None
    for t in tensors.values():
        if t is not None:
            value = getattr(t, attr)
            if first is None:
                first = value
            elif value != first:
                return False
    return True


def same_device(op: str, **tensors: torch.Tensor | None) -> None:
    if _one(tensors, "device"):
        return
    desc = ", ".join(f"{n} on {t.device}" for n, t in tensors.items() if t is not None)
    raise RlkInputError(f"rlk.{op}: all tensors must be on one device; got {desc}")


def same_dtype(op: str, **tensors: torch.Tensor | None) -> None:
    if _one(tensors, "dtype"):
        return
    desc = ", ".join(f"{n} {t.dtype}" for n, t in tensors.items() if t is not None)
    raise RlkInputError(f"rlk.{op}: dtypes must match; got {desc}")


def ndim(t: torch.Tensor, op: str, name: str, allowed: Iterable[int]) -> None:
    allowed = tuple(allowed)
    if t.dim() in allowed:
        return
    require(False, op, f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")


def values_checked(*tensors: torch.Tensor | None) -> bool:
    """Whether range checks on these tensors' values run: never for meta/fake tensors (no values);
    per ``RLK_VALUE_CHECKS`` otherwise (``auto``: only when all of them are on the CPU, because reading
    GPU values syncs the device on every call). The mode is read first: ``never``, and ``auto`` with a tensor
    off the CPU (a GPU or meta one), answer without the fake-tensor tests."""
    mode = envs.current("RLK_VALUE_CHECKS")
    if mode == "never":
        return False
    auto = mode == "auto"
    for t in tensors:
        if t is not None:
            if auto and not t.is_cpu:
                return False
            if t.is_meta or _is_fake(t):
                return False
    return auto or mode == "always"


def in_range(t: torch.Tensor, op: str, name: str, low: int, high: int) -> None:
    """Every element in [low, high), when :func:`values_checked` says value checks run."""
    if not values_checked(t) or t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    require(lo >= low and hi < high, op, f"{name} has values in [{lo}, {hi}]; allowed: [{low}, {high})")


def _is_fake(t: torch.Tensor) -> bool:
    # fake_tensor.is_fake, whose answer for a tensor of plain type that wraps nothing (neither functionalization nor
    # functorch) is False: that case without the call
    if type(t) in PLAIN and not compat.is_functional(t) and not compat.functorch_wrapped(t):
        return False
    return compat.is_fake(t)


# the tensor types taken as plain tensors: the fast path and the direct path take them past the dispatcher
# (rlk_core.ops.treat_as_plain adds types whose __torch_function__ only passes calls through), and no test of a
# tracer's tensor is needed for them here
PLAIN = {torch.Tensor, torch.nn.Parameter}
