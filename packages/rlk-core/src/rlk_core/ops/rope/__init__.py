"""``rope``: rotary position embedding (rotate-half layout) under contract ``rlk.rope.v1``."""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops._grad import backward_companion
from rlk_core.ops.rope.reference import rope_backward_reference, rope_cos_sin, rope_reference

MAX_POSITION = 1 << 24  # positions are exact in fp32 below this


def _check(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> None:
    # the common case in a few attribute tests; anything else takes the full checks (and their messages)
    if (isinstance(x, torch.Tensor) and isinstance(positions, torch.Tensor) and x.dtype in C.FLOAT_DTYPES
            and x.dim() == 3 and positions.dtype in C.INT_DTYPES and positions.dim() == 1
            and positions.shape[0] == x.shape[0] and 0 < rotary_dim <= x.shape[-1] and rotary_dim % 2 == 0
            and theta > 0.0 and x.device == positions.device):
        C.in_range(positions, "rope", "positions", 0, MAX_POSITION)
        return
    _check_full(x, positions, theta, rotary_dim)


def _check_full(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> None:
    """Every check with its message (what :func:`_check` runs where its few attribute tests do not pass)."""
    C.float_tensor(x, "rope", "x")
    C.ndim(x, "rope", "x", (3,))
    C.int_tensor(positions, "rope", "positions")
    C.ndim(positions, "rope", "positions", (1,))
    C.require(positions.shape[0] == x.shape[0], "rope",
              f"positions has {positions.shape[0]} entries but x has {x.shape[0]} tokens")
    C.require(0 < rotary_dim <= x.shape[-1] and rotary_dim % 2 == 0, "rope",
              f"rotary_dim must be even and in (0, {x.shape[-1]}], got {rotary_dim}")
    C.require(theta > 0.0, "rope", f"theta must be > 0, got {theta}")
    C.same_device("rope", x=x, positions=positions)
    C.in_range(positions, "rope", "positions", 0, MAX_POSITION)


@define("rope")
def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    _check(x, positions, theta, rotary_dim)


@_rope.register_fake
def _(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    _check(x, positions, theta, rotary_dim)
    return torch.empty_like(x)


@define("rope_backward")
def _rope_backward(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    _check(grad, positions, theta, rotary_dim)


@_rope_backward.register_fake
def _(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    _check(grad, positions, theta, rotary_dim)
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


# autograd: rope_backward(grad, positions, theta, rotary_dim) -> dx, a registry op (reported, forced with rope);
# only the positions are saved (the rotation does not read x)
backward_companion(_rope, "rope_backward", n_tensor_inputs=2, saved=(1,))


def reserve_tables(device: torch.device | str, rotary_dim: int, theta: float, max_positions: int) -> None:
    """Build the cached fp32 cos/sin tables of ``rlk.triton``'s rope for positions ``[0, max_positions)``
    now, and use them as they are from then on. A rope call under CUDA-graph capture cannot size its table
    from the positions (that needs a host sync), so a launcher that captures graphs (vLLM) reserves the
    model's maximum length first; a trainer reserves at model build so that no forward syncs the host
    (otherwise one ``positions.max()`` per call). Safe beside another reservation in the same process (a
    colocated vLLM): the table only grows, and a table it replaces stays allocated for the graphs captured
    on it (at most twice one table's memory, see :mod:`rlk_core.ops.rope.triton`). A token whose position
    is past the reserved rows gets NaN outputs (never an out-of-bounds read); under
    ``RLK_VALUE_CHECKS=always`` the forward raises instead. Does nothing where ``rlk.triton`` does not run
    rope (CPU, no Triton)."""
    dev = torch.device(device)
    C.require(max_positions > 0 and max_positions <= MAX_POSITION, "rope",
              f"max_positions must be in (0, {MAX_POSITION}], got {max_positions}")
    if dev.type != "cuda" or not REGISTRY.is_available(REGISTRY.get("rope", "rlk.triton"), "cuda")[0]:
        return
    from rlk_core.ops.rope import triton as kernels

    if dev.index is None:  # the tables are keyed by the tensors' device, which always has its index
        dev = torch.device("cuda", torch.cuda.current_device())
    kernels.reserve(dev, int(rotary_dim), float(theta), int(max_positions))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None) -> torch.Tensor:
    """Apply rotary embedding at absolute positions (contract ``rlk.rope.v1``).

    Parameters
    ----------
    x : Tensor ``[T, H, D]`` (tokens, heads, head dim), float32 / bfloat16 / float16.
    positions : int Tensor ``[T]``, the absolute position of each token in its sequence, in [0, 2^24).
    theta : float, ``rope_theta`` of the model config.
    rotary_dim : int, even, ``<= D`` (default ``D``); dims past it pass through.

    Returns
    -------
    Tensor ``[T, H, D]``, dtype of ``x``.

    Contract ``rlk.rope.v1``: each element depends only on its value, its partner in the rotate-half
    pair and its absolute position; cos/sin tables are built in fp32 by :func:`rope_cos_sin` (the same
    builder on both sides, never rounded to bf16); one rounding of the rotated values.

    Backward (op ``rope_backward``, same contract id): the rotation by ``-angle`` with the same table rows,
    ``dx1 = g1*cos + g2*sin``, ``dx2 = g2*cos - g1*sin`` in fp32 (products first), one rounding; dims past
    ``rotary_dim`` pass the gradient through. Elementwise: deterministic run to run.
    """
    return _rope(x, positions, float(theta), int(rotary_dim or x.shape[-1]))


REGISTRY.register(Backend("rlk.reference", "rope", rope_reference, devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(Backend("rlk.reference", "rope_backward", rope_backward_reference, devices=("cpu", "cuda"),
                          builtin=True))

__all__ = ["rope", "rope_cos_sin"]

M = "rlk_core.ops.rope.triton"
register_kernel_backends("rope", f"{M}:forward", f"{M}:supports")
register_kernel_backends("rope_backward", f"{M}:backward", f"{M}:supports")
