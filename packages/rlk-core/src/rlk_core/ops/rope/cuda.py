"""``rope`` on ``rlk.cuda``: ``rlk.triton``'s kernel (:mod:`rlk_core.ops.rope.triton`) from its AOT cubin,
launched by ``rlk_core._C``. The same cached cos/sin tables, config and grid as the Triton launcher; the
table's row count is passed per call (``N_POS``: positions past it give NaN, never an out-of-bounds read).

``supports`` and ``launch`` each keep one decision per call signature
(:class:`~rlk_core.ops._cuda_common.Launch`): the general code below (:func:`supports_general`,
:func:`launch_general`) decides it once; a signature seen before is one dict lookup (and one ``_C.run``).

``rope_backward`` (:func:`backward`): the Triton launcher's launch of ``_rope_bwd_kernel`` on the cached table
(``triton.backward_tables``) written once below against a :class:`~rlk_core.ops._cuda_calls.Calls`, resolved as the
JIT specialises it (the AOT variants of :mod:`rlk_core.aot.specs_backward`: the head count 1, a multiple of 16 or
neither, strides multiples of 16) and kept per call signature as a :class:`~rlk_core.ops._cuda_calls.Program` (one
``_C.run_program``). Launches no variant is are declined: ``rlk.triton`` runs them."""

from __future__ import annotations

import functools

import torch

from rlk_core.aot.specs import TRITON_TYPE
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops._triton_common import next_pow2
from rlk_core.ops.rope import triton as tr

KERNEL = "_rope_fwd_kernel"
_SUPPORTS = cc.records()
_LAUNCHES = cc.records()


@functools.cache
def _variant(
    device: int, dtype: torch.dtype, pos: torch.dtype, nh: int, d: int, r: int, layout: str
) -> tuple[int, int] | None:
    c = tr.config(nh, r // 2)
    const = dict(
        HALF=r // 2,
        D=d,
        R=r,
        BLOCK_H=c["BLOCK_H"],
        BLOCK_HALF=c["BLOCK_HALF"],
        BLOCK_PASS=next_pow2(d - r) if d > r else 0,
    )
    name = f"{TRITON_TYPE[dtype]},pos={'i32' if pos == torch.int32 else 'i64'}"
    entry = cc.lookup(device, KERNEL, name, layout, const)
    return None if entry is None else (cc.handle(device, entry), c["BLOCK_H"])


def _layout(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor | None
) -> str:
    ok = cc.aligned(x, positions, cos, sin, x.shape[1], x.stride(0), x.stride(1))
    if y is not None:
        ok = ok and cc.aligned(y, y.stride(0), y.stride(1))
    return "aligned" if ok else "generic"


def _decide_launch(key: tuple, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rotary_dim: int) -> cc.Launch | None:
    t, nh, d = x.shape
    record = None
    if t and nh and x.stride(-1) == 1:  # launch_general copies x otherwise
        # y: a fresh [t, nh, d] (16-byte aligned: its strides alone decide here; _C.run checks the pointer)
        ok = cc.aligned(x, positions, cos, sin, nh, x.stride(0), x.stride(1)) and cc.aligned(nh * d, d)
        layout = "aligned" if ok else "generic"
        hdl, block_h = _variant(x.device.index, x.dtype, positions.dtype, nh, d, rotary_dim, layout)
        record = cc.Launch(hdl, (t, -(-nh // block_h), 1), (t, nh, d), (t, nh, d), 0, layout == "aligned",
                           ((cc.T, 0), (cc.T, 1), (cc.T, 2), (cc.T, 3), (cc.O, 0), (cc.C, t), (cc.C, nh),
                            (cc.S, 4), (cc.C, x.stride(0)), (cc.C, x.stride(1)), (cc.C, nh * d), (cc.C, d)))
    return cc.remember(_LAUNCHES, key, (record,))[0]


def launch(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    key = (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, positions.dtype,
           positions.data_ptr() & 15, cos.data_ptr() & 15, sin.data_ptr() & 15, rotary_dim)
    hit = _LAUNCHES.get(key)
    record = hit[0] if hit is not None else _decide_launch(key, x, positions, cos, sin, rotary_dim)
    if record is not None:
        y = cc.run(record, x, positions, cos, sin, cos.shape[0])  # the table's rows: N_POS
        if y is not None:
            return y
    return launch_general(x, positions, cos, sin, rotary_dim)


def launch_general(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    t, nh, d = x.shape
    y = torch.empty((t, nh, d), dtype=x.dtype, device=x.device)
    if t == 0 or nh == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    layout = _layout(x, positions, cos, sin, y)
    hdl, block_h = _variant(x.device.index, x.dtype, positions.dtype, nh, d, rotary_dim, layout)
    cc.launch(
        hdl,
        t,
        -(-nh // block_h),
        1,
        x,
        positions,
        cos,
        sin,
        y,
        t,
        nh,
        cos.shape[0],
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
    )
    return y


def forward(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.empty_like(x)
    return launch(x, positions, *tr.forward_tables(x, positions, theta, rotary_dim), rotary_dim)


def supports(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> tuple[bool, str]:
    if cc.without_storage(x, positions):
        return cc.NO_STORAGE
    key = (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, positions.dtype,
           positions.data_ptr() & 15, rotary_dim)
    said = _SUPPORTS.get(key)
    if said is None:
        said = cc.remember(_SUPPORTS, key, supports_general(x, positions, theta, rotary_dim))
    return said


def supports_general(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> tuple[bool, str]:
    if x.dtype not in TRITON_TYPE or positions.dtype not in (torch.int32, torch.int64):
        return False, f"no AOT variant for x {x.dtype}, positions {positions.dtype}"
    t, nh, d = x.shape
    if t == 0 or nh == 0:
        return True, ""
    xs = x if x.stride(-1) == 1 else x.contiguous()
    if not cc.fits_i32(t, nh, xs.stride(0), xs.stride(1), t * nh * d):
        return False, "sizes past int32 (the JIT's i64 variant)"
    if nh >= 65535 * tr.config(nh, rotary_dim // 2)["BLOCK_H"]:
        return False, "too many heads for the grid"
    # the tables are 16-byte aligned allocations (rows of rotary_dim/2 fp32 start at their base)
    layout = "aligned" if cc.aligned(xs, positions, nh, xs.stride(0), xs.stride(1)) else "generic"
    if layout == "generic" and "rope" not in cc.GENERIC_BITWISE:
        return False, "operands not 16-byte aligned / sizes not multiples of 16: the JIT's own variant serves"
    if _variant(x.device.index, x.dtype, positions.dtype, nh, d, rotary_dim, layout) is None:
        return False, f"no AOT variant for (head_dim, rotary_dim, heads) = ({d}, {rotary_dim}, {nh}) ({layout})"
    return True, ""


# -- rope_backward: the Triton launcher's launch (triton.launch with _rope_bwd_kernel), on a Calls -------------------
def _backward(calls: cl.Calls, grad: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              rotary_dim: int) -> tuple:
    t, nh, d = grad.shape
    dx = calls.new((t, nh, d), grad.dtype)
    if t == 0 or nh == 0:
        return (dx,)
    g = grad if grad.stride(-1) == 1 else calls.contiguous(grad)
    c = tr.config(nh, rotary_dim // 2)
    args = cl.positional(tr._rope_bwd_kernel, g, positions, cos, sin, dx, t, nh, cos.shape[0], g.stride(0), g.stride(1),
                         nh * d, d, HALF=rotary_dim // 2, D=d, R=rotary_dim, BLOCK_H=c["BLOCK_H"],
                         BLOCK_HALF=c["BLOCK_HALF"], BLOCK_PASS=next_pow2(d - rotary_dim) if d > rotary_dim else 0)
    pos = cl.POINTER_TYPES.get(cl.type_name(positions.dtype), "?")[1:]
    calls.launch(tr._rope_bwd_kernel, (t, -(-nh // c["BLOCK_H"])), args,
                 {"num_warps": c["num_warps"], "enable_fp_fusion": False},
                 f"{TRITON_TYPE.get(grad.dtype, grad.dtype)},pos={pos}")
    return (dx,)


_BACKWARD = cl.Served("rope_backward", _backward, lambda *_: (True, ""), lambda g, p, c, s, r: (g, p, c, s),
                      lambda g, p, c, s, r: (r,), rebuild=lambda outs: outs[0])


def backward(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    if grad.shape[0] == 0:
        return torch.empty_like(grad)
    return _BACKWARD.run(grad, positions, *tr.backward_tables(grad, positions, theta, rotary_dim), rotary_dim)


def supports_backward(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> tuple[bool, str]:
    """Decided on the table the call reads (``triton.backward_tables``: the forward's, cached; built here, as the
    call would build it, only where none is)."""
    if cc.without_storage(grad, positions):
        return cc.NO_STORAGE
    if grad.shape[0] == 0:
        return True, ""
    return _BACKWARD.supports(grad, positions, *tr.backward_tables(grad, positions, theta, rotary_dim), rotary_dim)
