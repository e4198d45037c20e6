"""Triton RoPE (rotate-half layout) under contract ``rlk.rope.v1`` (backend ``rlk.triton``).

The fp32 cos/sin tables come from the reference builder :func:`rope_cos_sin`, run on the GPU over
positions ``0 .. cap-1`` and cached per ``(device, rotary_dim, theta)`` (``cap`` doubles when a larger
position arrives). Every table element is an elementwise function of its own position, so the cached
row of position ``p`` has the same bits as a table built for ``p`` alone — train and rollout read
identical tables. The kernel gathers the row of each token's position and computes, in fp32 with
fp-contraction off (``enable_fp_fusion=False``: products rounded, then the add/subtract, exactly the
reference's arithmetic), ``out1 = x1*cos - x2*sin``, ``out2 = x2*cos + x1*sin``, one rounding;
dims ``R..D`` are copied. Expected bitwise equal to the reference on the same device.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from rlk_core.errors import RlkInputError
from rlk_core.ops._triton_common import next_pow2
from rlk_core.ops.rope.reference import rope_cos_sin

MIN_CAP = 4096
_TABLES: dict[tuple[str, int, float], tuple[int, torch.Tensor, torch.Tensor]] = {}
_RESERVED: set[tuple[str, int, float]] = set()  # tables reserved for a model's whole length (reserve_tables)
_LOCK = threading.Lock()


def reserve(device: torch.device, rotary_dim: int, theta: float, max_positions: int) -> None:
    """Build the table for positions ``[0, max_positions)`` and mark it usable under CUDA-graph capture."""
    tables(device, rotary_dim, theta, max_positions)
    _RESERVED.add((str(device), rotary_dim, float(theta)))


def reserved_tables(device: torch.device, rotary_dim: int, theta: float
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The table reserved for every position the model can see (:func:`rlk_core.ops.rope.reserve_tables`), or
    None. A reserved table is used as it is: no host sync to size it from the positions (which CUDA-graph
    capture forbids and which stalls every eager call), and it is never replaced, so a captured graph never
    reads freed memory. A table only sized by earlier calls is not trusted under capture."""
    key = (str(device), rotary_dim, float(theta))
    hit = _TABLES.get(key) if key in _RESERVED else None
    return None if hit is None else (hit[1], hit[2])


def cached_tables(device: torch.device, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cached table as it is (any size), or None: for a caller whose positions a forward already sized
    it for (the backward)."""
    hit = _TABLES.get((str(device), rotary_dim, float(theta)))
    return None if hit is None else (hit[1], hit[2])


def tables(device: torch.device, rotary_dim: int, theta: float, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[cap, rotary_dim/2]`` with ``cap >= need``, from the reference builder."""
    key = (str(device), rotary_dim, float(theta))
    with _LOCK:
        hit = _TABLES.get(key)
        if hit is None or hit[0] < need:
            cap = max(MIN_CAP, next_pow2(need))
            pos = torch.arange(cap, dtype=torch.int64, device=device)
            cos, sin = rope_cos_sin(pos, rotary_dim, theta)
            hit = (cap, cos.contiguous(), sin.contiguous())
            _TABLES[key] = hit
    return hit[1], hit[2]


def config(n_heads: int, half: int) -> dict[str, int]:
    block_half = next_pow2(half)
    block_h = max(1, min(next_pow2(n_heads), 4096 // block_half))
    return {"BLOCK_H": block_h, "BLOCK_HALF": block_half,
            "num_warps": max(1, min(8, block_h * block_half // 256))}


@triton.jit(do_not_specialize=["T"])
def _rope_fwd_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, T, NH,
                     stride_xt, stride_xh, stride_yt, stride_yh,
                     HALF: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + i, mask=i < HALF, other=0.0)
    mask = (heads[:, None] < NH) & (i[None, :] < HALF)
    xb = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    yb = y_ptr + t * stride_yt + heads[:, None] * stride_yh
    x1 = tl.load(xb + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(yb + i[None, :], o1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(yb + HALF + i[None, :], o2.to(y_ptr.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        j = tl.arange(0, BLOCK_PASS)
        pmask = (heads[:, None] < NH) & (j[None, :] < D - R)
        rest = tl.load(xb + R + j[None, :], mask=pmask, other=0.0)
        tl.store(yb + R + j[None, :], rest, mask=pmask)


def launch(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotary_dim: int) -> torch.Tensor:
    """Run the kernel with tables from :func:`tables` (rows must cover every position)."""
    t, nh, d = x.shape
    y = torch.empty((t, nh, d), dtype=x.dtype, device=x.device)
    if t == 0 or nh == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    c = config(nh, rotary_dim // 2)
    block_pass = next_pow2(d - rotary_dim) if d > rotary_dim else 0
    grid = (t, triton.cdiv(nh, c["BLOCK_H"]))
    _rope_fwd_kernel[grid](x, positions, cos, sin, y, t, nh,
                           x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                           HALF=rotary_dim // 2, D=d, R=rotary_dim, BLOCK_PASS=block_pass,
                           enable_fp_fusion=False, **c)
    return y


def forward_tables(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(cos, sin)`` table a forward call reads (rlk.triton's and rlk.cuda's): the reserved one as it is,
    else one sized from the positions (a host sync, refused under CUDA-graph capture)."""
    reserved = reserved_tables(x.device, rotary_dim, theta)
    if reserved is not None:
        return reserved
    if torch.cuda.is_current_stream_capturing():
        raise RlkInputError(f"rope under CUDA-graph capture: no cos/sin table reserved for rotary_dim={rotary_dim}, "
                            f"theta={theta} on {x.device}; call rlk_core.ops.rope.reserve_tables(device, "
                            "rotary_dim, theta, max_positions) before capturing")
    return tables(x.device, rotary_dim, theta, int(positions.max()) + 1)  # one host sync for the table size


def forward(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.empty_like(x)
    return launch(x, positions, *forward_tables(x, positions, theta, rotary_dim), rotary_dim)


def supports(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> tuple[bool, str]:
    return True, ""
