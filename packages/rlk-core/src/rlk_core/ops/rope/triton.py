"""Triton RoPE (rotate-half layout) under contract ``rlk.rope.v1`` (backend ``rlk.triton``).

The fp32 cos/sin tables come from the reference builder :func:`rope_cos_sin`, run on the GPU over
positions ``0 .. cap-1`` and cached per ``(device, rotary_dim, theta)`` (``cap`` doubles when a larger
position arrives). Every table element is an elementwise function of its own position, so the cached
row of position ``p`` has the same bits as a table built for ``p`` alone — train and rollout read
identical tables. The kernel gathers the row of each token's position and computes, in fp32 with
fp-contraction off (``enable_fp_fusion=False``: products rounded, then the add/subtract, exactly the
reference's arithmetic), ``out1 = x1*cos - x2*sin``, ``out2 = x2*cos + x1*sin``, one rounding;
dims ``R..D`` are copied. Expected bitwise equal to the reference on the same device.

Backward (:func:`backward`): the rotation by ``-theta`` with the same table rows, ``_rope_bwd_kernel`` — the
forward's code with ``sin`` negated (an exact operation), so ``dx1 = g1*cos + g2*sin``, ``dx2 = g2*cos -
g1*sin`` exactly as the reference backward computes them (bitwise equal to it on the same device, like the
forward); dims ``R..D`` of the gradient pass through.

**Positions past the table.** Both kernels take the table's row count and never read past it: a token
whose position is outside ``[0, rows)`` gets NaN in every output dim (rotated and passed-through), so a
reserved table too short for the model is loud, not an out-of-bounds read. Under
``RLK_VALUE_CHECKS=always`` a forward on a reserved table raises instead (a host sync per call).

**Table lifetime.** A table that grows is replaced in the cache, but the tensors it replaces are kept alive
(:data:`_RETIRED`) for the life of the process: a CUDA graph captured on an earlier table (vLLM's, colocated
with a trainer that reserves a longer one) keeps reading valid memory. Tables grow by doubling from
``MIN_CAP``, so the retired ones together are smaller than the live one: at most twice a table's memory,
``2 * cap * rotary_dim * 4`` bytes (cos and sin, fp32) per ``(device, rotary_dim, theta)``; 64 MiB for a
reserved 65536-position table of rotary dim 128.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from rlk_core.errors import RlkInputError
from rlk_core.ops import _checks as C
from rlk_core.ops._plan import hold, invalidate, next_pow2
from rlk_core.ops.rope.reference import rope_cos_sin

MIN_CAP = 4096
_TABLES: dict[tuple[str, int, float], tuple[int, torch.Tensor, torch.Tensor]] = {}
_RESERVED: set[tuple[str, int, float]] = set()  # tables reserved for a model's whole length (reserve_tables)
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []  # replaced tables, kept alive (see the module docstring)
_LOCK = threading.Lock()


def reserve(device: torch.device, rotary_dim: int, theta: float, max_positions: int) -> None:
    """Build the table for positions ``[0, max_positions)`` and mark it usable under CUDA-graph capture (and by
    the ops' fast path, which holds a reserved table in place of this lookup until a table is replaced)."""
    cos, sin = tables(device, rotary_dim, theta, max_positions)
    _RESERVED.add((str(device), rotary_dim, float(theta)))
    hold(cos, sin)


def reserved_tables(device: torch.device, rotary_dim: int, theta: float
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The table reserved for every position the model can see (:func:`rlk_core.ops.rope.reserve_tables`), or
    None. A reserved table is used as it is: no host sync to size it from the positions (which CUDA-graph
    capture forbids and which stalls every eager call). Where a later reservation grows it, the grown table
    is used from then on and the earlier one stays alive for the graphs that read it. A table only sized by
    earlier calls is not trusted under capture."""
    key = (str(device), rotary_dim, float(theta))
    hit = _TABLES.get(key) if key in _RESERVED else None
    return None if hit is None else (hit[1], hit[2])


def cached_tables(device: torch.device, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cached table as it is (any size), or None."""
    hit = _TABLES.get((str(device), rotary_dim, float(theta)))
    return None if hit is None else (hit[1], hit[2])


def tables(device: torch.device, rotary_dim: int, theta: float, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` of shape ``[cap, rotary_dim/2]`` with ``cap >= need``, from the reference builder. A
    table too small is replaced by a larger one; the replaced tensors are retired, never freed."""
    key = (str(device), rotary_dim, float(theta))
    with _LOCK:
        hit = _TABLES.get(key)
        if hit is None or hit[0] < need:
            cap = max(MIN_CAP, next_pow2(need))
            pos = torch.arange(cap, dtype=torch.int64, device=device)
            cos, sin = rope_cos_sin(pos, rotary_dim, theta)
            replaced = hit is not None
            if replaced:
                _RETIRED.append((hit[1], hit[2]))
            hit = (cap, cos.contiguous(), sin.contiguous())
            _TABLES[key] = hit
            if replaced:
                invalidate()  # a kept launch program may hold the address of the table this one replaces
    return hit[1], hit[2]


def config(n_heads: int, half: int) -> dict[str, int]:
    block_half = next_pow2(half)
    block_h = max(1, min(next_pow2(n_heads), 4096 // block_half))
    return {"BLOCK_H": block_h, "BLOCK_HALF": block_half,
            "num_warps": max(1, min(8, block_h * block_half // 256))}


@triton.jit
def _rotate(x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, NH, N_POS, stride_xt, stride_xh, stride_yt, stride_yh,
            HALF: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, NEGATE_SIN: tl.constexpr):
    """One token's heads ``[BLOCK_H]``: rotated by the angle of its position (by minus it: ``NEGATE_SIN``)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    inside = (pos >= 0) & (pos < N_POS)  # a position past the table reads nothing and writes NaN
    row = tl.where(inside, pos, 0)
    cos = tl.load(cos_ptr + row * HALF + i, mask=(i < HALF) & inside, other=float("nan"))
    sin = tl.load(sin_ptr + row * HALF + i, mask=(i < HALF) & inside, other=float("nan"))
    if NEGATE_SIN:
        sin = -sin
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
        rest = tl.load(xb + R + j[None, :], mask=pmask, other=0.0).to(tl.float32)  # exact for every input dtype
        tl.store(yb + R + j[None, :], tl.where(inside, rest, float("nan")).to(y_ptr.dtype.element_ty), mask=pmask)


@triton.jit(do_not_specialize=["T", "N_POS"])
def _rope_fwd_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, T, NH, N_POS,
                     stride_xt, stride_xh, stride_yt, stride_yh,
                     HALF: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    _rotate(x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, NH, N_POS, stride_xt, stride_xh, stride_yt, stride_yh,
            HALF, D, R, BLOCK_H, BLOCK_HALF, BLOCK_PASS, False)


@triton.jit(do_not_specialize=["T", "N_POS"])
def _rope_bwd_kernel(g_ptr, pos_ptr, cos_ptr, sin_ptr, dx_ptr, T, NH, N_POS,
                     stride_gt, stride_gh, stride_dxt, stride_dxh,
                     HALF: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    _rotate(g_ptr, pos_ptr, cos_ptr, sin_ptr, dx_ptr, NH, N_POS, stride_gt, stride_gh, stride_dxt, stride_dxh,
            HALF, D, R, BLOCK_H, BLOCK_HALF, BLOCK_PASS, True)


def launch(p, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           rotary_dim: int, kernel=_rope_fwd_kernel) -> torch.Tensor:
    """Run ``kernel`` (the forward, or :data:`_rope_bwd_kernel` on a gradient) with tables from :func:`tables`;
    tokens whose position is past the table's rows get NaN."""
    t, nh, d = x.shape
    y = p.new((t, nh, d), x.dtype)
    if t == 0 or nh == 0:
        return y
    if x.stride(-1) != 1:
        x = p.contiguous(x)
    c = config(nh, rotary_dim // 2)
    block_pass = next_pow2(d - rotary_dim) if d > rotary_dim else 0
    p.launch(kernel, (t, triton.cdiv(nh, c["BLOCK_H"])), x, positions, cos, sin, y, t, nh, cos.shape[0],
             x.stride(0), x.stride(1), nh * d, d, HALF=rotary_dim // 2, D=d, R=rotary_dim, BLOCK_PASS=block_pass,
             enable_fp_fusion=False, **c)
    return y


def forward_tables(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(cos, sin)`` table a forward call reads (rlk.triton's and rlk.cuda's): the reserved one as it is
    (no host sync; under ``RLK_VALUE_CHECKS=always`` positions past it raise), else one sized from the
    positions (a host sync, refused under CUDA-graph capture)."""
    reserved = reserved_tables(x.device, rotary_dim, theta)
    if reserved is not None:
        if positions.numel() and C.values_checked(positions):
            hi, rows = int(positions.max()), reserved[0].shape[0]
            C.require(hi < rows, "rope", f"position {hi} is past the reserved cos/sin table of {rows} rows "
                      f"(rotary_dim={rotary_dim}, theta={theta}); reserve_tables a longer one")
        return reserved
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RlkInputError(f"rope under CUDA-graph capture: no cos/sin table reserved for rotary_dim={rotary_dim}, "
                            f"theta={theta} on {x.device}; call rlk_core.ops.rope.reserve_tables(device, "
                            "rotary_dim, theta, max_positions) before capturing")
    return tables(x.device, rotary_dim, theta, int(positions.max()) + 1)  # one host sync for the table size


def backward_tables(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The table a backward call reads: the cached one as it is — the forward's (a forward on this device
    reserved it or sized it for these positions, and tables only grow) — with no host sync; where none is
    cached (the forward read no table), one built from the positions (a host sync)."""
    hit = cached_tables(grad.device, rotary_dim, theta)
    return hit if hit is not None else tables(grad.device, rotary_dim, theta, int(positions.max()) + 1)


def forward(p, x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    if x.shape[0] == 0:
        return p.new(x.shape, x.dtype)
    return launch(p, x, positions, *forward_tables(x, positions, theta, rotary_dim), rotary_dim)


def backward(p, grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """``dx`` of ``rope`` for the output gradient ``grad [T, H, D]`` (see the module docstring)."""
    if grad.shape[0] == 0:
        return p.new(grad.shape, grad.dtype)
    return launch(p, grad, positions, *backward_tables(grad, positions, theta, rotary_dim), rotary_dim,
                  kernel=_rope_bwd_kernel)


def supports(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> tuple[bool, str]:
    return True, ""


SHAPES = ((64, 64), (128, 128), (256, 256), (128, 64))  # (head_dim, rotary_dim) pairs the AOT build compiles


def build_calls(dtype: torch.dtype, sms: int):
    """For each ``(head_dim, rotary_dim)`` of :data:`SHAPES` (``D`` and ``R`` are constexprs: each pair is a family
    of binaries): per distinct ``config(heads, rotary_dim // 2)`` and class of the head count (the JIT specialises
    ``NH``: 1, a multiple of 16, neither — ``config`` reads ``next_pow2(heads)`` only, so 1, 2 and each power of two
    ``p >= 4`` with ``p - 1`` cover them), positions int32 or int64: the forward and the backward."""
    heads = sorted({1, 2, *(q for i in range(2, 17) for q in ((1 << i) - 1, 1 << i))})
    for d, r in SHAPES:
        seen = set()
        for nh in heads:
            cls = (tuple(sorted(config(nh, r // 2).items())), "1" if nh == 1 else "16" if nh % 16 == 0 else "")
            if cls in seen:
                continue
            seen.add(cls)
            for pos in (torch.int32, torch.int64):
                x = torch.empty((8, nh, d), dtype=dtype, device="meta")
                positions = torch.empty((8,), dtype=pos, device="meta")
                cos = torch.empty((4096, r // 2), dtype=torch.float32, device="meta")
                yield launch, (x, positions, cos, cos, r)
                yield launch, (x, positions, cos, cos, r, _rope_bwd_kernel)
