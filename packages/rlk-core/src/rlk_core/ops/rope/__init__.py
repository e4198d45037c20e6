"""``rope``: rotary position embedding (rotate-half layout) under contract ``rlk.rope.v1``."""

from __future__ import annotations

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops._dispatch import call, custom_op, run
from rlk_core.ops._grad import closed_form_backward
from rlk_core.ops.rope.reference import (
    rope_backward_reference,
    rope_backward_with,
    rope_cos_sin,
    rope_reference,
)

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


@custom_op("rope")
def _rope_op(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    _check(x, positions, theta, rotary_dim)
    return run("rope", x.device, x, positions, theta, rotary_dim)


@_rope_op.register_fake
def _(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    _check(x, positions, theta, rotary_dim)
    return torch.empty_like(x)


_TABLE_BACKENDS = ("rlk.triton", "rlk.cuda")  # the backends whose forward reads rlk.triton's cached table
_TABLE_DEVICES = ("cuda",)


def _rope_backward(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int, grad: torch.Tensor
                   ) -> tuple[torch.Tensor, None]:
    """The closed-form backward (:func:`rope_backward_reference`). On a GPU the cos/sin rows are gathered
    from the table the forward used (``rlk.triton``'s cache: the same function of the position, element by
    element, so the same bits) instead of recomputed with ~40 float64 launches per call. Only where the
    forward ran a backend that reads that table (the registry selects the same one for the same inputs): its
    call sized the table for these positions (tables only grow), so the gather stays inside it. Otherwise the
    reference recomputes the rows."""
    device_type = x.device.type
    if device_type in _TABLE_DEVICES and REGISTRY.select("rope", device_type, (x, positions, theta, rotary_dim),
                                                         strict=False).backend.id in _TABLE_BACKENDS:
        from rlk_core.ops.rope import triton as rope_triton

        hit = rope_triton.cached_tables(x.device, rotary_dim, theta)
        if hit is not None:
            rows = positions.reshape(-1)
            return rope_backward_with(hit[0].index_select(0, rows), hit[1].index_select(0, rows), x, rotary_dim,
                                      grad)
    return rope_backward_reference(x, positions, theta, rotary_dim, grad)


closed_form_backward(_rope_op, _rope_backward, n_tensor_inputs=2)


def reserve_tables(device: torch.device | str, rotary_dim: int, theta: float, max_positions: int) -> None:
    """Build the cached fp32 cos/sin tables of ``rlk.triton``'s rope for positions ``[0, max_positions)``
    now. A rope call under CUDA-graph capture cannot size its table from the positions (that needs a host
    sync) and must not see it replaced later, so a launcher that captures graphs (vLLM) reserves the model's
    maximum length first. Does nothing where ``rlk.triton`` does not run rope (CPU, no Triton)."""
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
    """
    return call("rope", x, positions, float(theta), int(rotary_dim or x.shape[-1]))


REGISTRY.register(Backend("rlk.reference", "rope", rope_reference, devices=("cpu", "cuda"), builtin=True))

__all__ = ["rope", "rope_cos_sin"]

from rlk_core.ops._triton_common import triton_backend  # noqa: E402  (imports no Triton until used on CUDA)

REGISTRY.register(triton_backend("rope"))

from rlk_core.ops._cuda_common import cuda_backend  # noqa: E402  (imports neither Triton nor the extension)

REGISTRY.register(cuda_backend("rope"))
