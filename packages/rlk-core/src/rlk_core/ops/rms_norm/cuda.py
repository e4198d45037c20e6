"""``rms_norm`` on ``rlk.cuda``: ``rlk.triton``'s kernel (:mod:`rlk_core.ops.rms_norm.triton`) from its AOT
cubin, launched by ``rlk_core._C``. Same preparation, config and grid as the Triton launcher.

``supports`` and ``forward`` share one decision per call signature (:class:`~rlk_core.ops._cuda_common.Launch`):
the general code below (:func:`supports_general`, :func:`forward_general`) decides it once; a signature seen
before is one dict lookup and one ``_C.run``.

``rms_norm_backward`` (:func:`backward`): the Triton launcher's two launches (``_rms_norm_bwd_kernel``, then the
``dweight`` merge ``_rms_norm_bwd_dw_kernel``) written once below against a :class:`~rlk_core.ops._cuda_calls.Calls`,
each resolved as the JIT specialises it (the AOT variants of :mod:`rlk_core.aot.specs_backward`); a call signature
is decided once and kept as a :class:`~rlk_core.ops._cuda_calls.Program` (dx, the partials and dweight allocated and
both kernels launched by one ``_C.run_program``). Launches no variant is (sizes not multiples of 16, misaligned
views, another gradient dtype) are declined: ``rlk.triton`` runs them."""

from __future__ import annotations

import functools

import torch

from rlk_core.aot.specs import TRITON_TYPE
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops.rms_norm import triton as tr

KERNEL = "_rms_norm_fwd_kernel"
_RECORDS = cc.records()


@functools.cache
def _variant(device: int, dtype: torch.dtype, wdtype: torch.dtype, h: int, layout: str) -> tuple[int, int] | None:
    c = tr.config(h)
    name = TRITON_TYPE[dtype] if wdtype == dtype else f"{TRITON_TYPE[dtype]},w={TRITON_TYPE[wdtype]}"
    entry = cc.lookup(device, KERNEL, name, layout, {"BLOCK_H": c["BLOCK_H"], "ROWS": c["ROWS"]})
    return None if entry is None else (cc.handle(device, entry), c["ROWS"])


def _prepare(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    return x2, w, "aligned" if cc.aligned(x2, w, h, x2.stride(0)) else "generic"


def _decide(key: tuple, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    said = supports_general(x, weight)
    launch = None
    h = x.shape[-1]
    if said[0] and weight.stride(0) == 1 and h > 0:
        try:
            x2 = x.view(-1, h)  # forward_general's reshape, where it is a view (no copy)
        except RuntimeError:
            x2 = None
        if x2 is not None and x2.stride(-1) == 1 and x2.shape[0] > 0:
            m = x2.shape[0]
            layout = "aligned" if cc.aligned(x2, weight, h, x2.stride(0)) else "generic"
            hdl, rows = _variant(x.device.index, x.dtype, weight.dtype, h, layout)
            # launch(hdl, grid, x2, w, y, m, h, x2.stride(0), y.stride(0), eps); y: a fresh [m, h]
            launch = cc.Launch(hdl, (-(-m // rows), 1, 1), (m, h), tuple(x.shape), 0, layout == "aligned",
                               ((cc.T, 0), (cc.T, 1), (cc.O, 0), (cc.C, m), (cc.C, h), (cc.C, x2.stride(0)),
                                (cc.C, h), (cc.S, 2)))
    return cc.remember(_RECORDS, key, (said, launch))


def _signature(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """The call signature a decision is kept under: shapes, strides, dtypes, device, pointer alignment."""
    return (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, weight.dtype, weight.stride(),
            weight.data_ptr() & 15)


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    key = _signature(x, weight)
    decision = _RECORDS.get(key) or _decide(key, x, weight)
    if decision[1] is not None:
        y = cc.run(decision[1], x, weight, eps)
        if y is not None:
            return y
    return forward_general(x, weight, eps)


def supports(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[bool, str]:
    if cc.without_storage(x, weight):
        return cc.NO_STORAGE
    key = _signature(x, weight)
    return (_RECORDS.get(key) or _decide(key, x, weight))[0]


def forward_general(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2, w, layout = _prepare(x, weight)
    m, h = x2.shape
    y = torch.empty((m, h), dtype=x.dtype, device=x.device)
    if m > 0:
        layout = layout if y.data_ptr() % 16 == 0 else "generic"
        hdl, rows = _variant(x.device.index, x.dtype, w.dtype, h, layout)
        cc.launch(hdl, -(-m // rows), 1, 1, x2, w, y, m, h, x2.stride(0), y.stride(0), eps)
    return y.reshape(x.shape)


def supports_general(x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> tuple[bool, str]:
    if x.dtype not in TRITON_TYPE or weight.dtype not in (x.dtype, torch.float32):
        return False, f"no AOT variant for x {x.dtype}, weight {weight.dtype}"
    h = x.shape[-1]
    if h > tr.MAX_H:
        return False, f"H={h} > {tr.MAX_H}"
    x2, _, layout = _prepare(x, weight)  # the output is a fresh, 16-byte aligned allocation
    if not cc.fits_i32(x2.shape[0], h, x2.stride(0), x2.shape[0] * h):
        return False, "sizes past int32 (the JIT's i64 variant)"
    if layout == "generic" and "rms_norm" not in cc.GENERIC_BITWISE:
        return False, "operands not 16-byte aligned / H not a multiple of 16: the JIT's own variant serves"
    if _variant(x.device.index, x.dtype, weight.dtype, h, layout) is None:
        return False, f"no AOT variant for H={h} ({layout})"
    return True, ""


# -- rms_norm_backward: the Triton launcher's two launches (triton.backward), on a Calls ----------------------------
def _rows_view(calls: cl.Calls, t: torch.Tensor):
    """``triton.rows_view`` of ``t``: ``(pointer argument, [A, NH, H] view)`` — a :class:`~rlk_core.ops._cuda_calls.
    Slice` of ``t`` where the view needs no copy (a program records it), else the copy (run from Python)."""
    copied = []

    def copy(u: torch.Tensor) -> torch.Tensor:
        copied.append(u)
        return calls.contiguous(u)

    t3 = tr.rows_view(t, copy)
    return (t3, t3) if copied else (cl.Slice(t, t3), t3)


def _backward(calls: cl.Calls, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    h = x.shape[-1]
    m = x.numel() // h if h else 0
    dx = calls.new(x.shape, x.dtype)
    if m == 0:
        return dx, calls.new((h,), weight.dtype, "zeros")
    (xp, x3), (gp, g3) = _rows_view(calls, x), _rows_view(calls, grad)
    w = weight if weight.stride(0) == 1 else calls.contiguous(weight)
    rpp, programs = tr.partition(m, h)
    part = calls.new((programs, h), torch.float32)
    c = tr.config(h)
    args = cl.positional(tr._rms_norm_bwd_kernel, xp, w, gp, dx, part, m, h, x3.shape[1], rpp, x3.stride(0),
                         x3.stride(1), g3.stride(0), g3.stride(1), float(eps), BLOCK_H=c["BLOCK_H"], ROWS=c["ROWS"])
    calls.launch(tr._rms_norm_bwd_kernel, (programs,), args, {"num_warps": c["num_warps"]},
                 _bwd_name(x.dtype, w.dtype))
    dw = calls.new((h,), weight.dtype)
    args = cl.positional(tr._rms_norm_bwd_dw_kernel, part, dw, programs, h, BLOCK_P=tr.DW_BLOCK_P,
                         BLOCK_N=tr.DW_BLOCK_N)
    calls.launch(tr._rms_norm_bwd_dw_kernel, (-(-h // tr.DW_BLOCK_N),), args, {"num_warps": tr.DW_WARPS},
                 f"dw={TRITON_TYPE.get(weight.dtype)}")
    return dx, dw


def _bwd_name(dtype: torch.dtype, wdtype: torch.dtype) -> str:
    from rlk_core.aot.specs_backward import rms_name

    if dtype not in TRITON_TYPE or wdtype not in TRITON_TYPE:
        return f"{dtype},w={wdtype}"  # no variant has this name: resolve declines the launch
    return rms_name(dtype, wdtype)


def _said_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[bool, str]:
    if grad.dtype != x.dtype:
        return False, f"grad {grad.dtype} and x {x.dtype}: only a gradient of x's dtype is built"
    return tr.supports(x, weight, eps)


_BACKWARD = cl.Served("rms_norm_backward", _backward, _said_backward, lambda grad, x, w, eps: (grad, x, w),
                      lambda grad, x, w, eps: (float(eps),))
backward, supports_backward = _BACKWARD.run, _BACKWARD.supports
