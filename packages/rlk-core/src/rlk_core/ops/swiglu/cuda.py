"""``swiglu`` on ``rlk.cuda``: ``rlk.triton``'s kernel (:mod:`rlk_core.ops.swiglu.triton`) from its AOT cubin,
launched by ``rlk_core._C``. Same preparation, config and grid as the Triton launcher.

``supports`` and ``forward`` share one decision per call signature (:class:`~rlk_core.ops._cuda_common.Launch`):
the general code below (:func:`supports_general`, :func:`forward_general`) decides it once; a signature seen
before is one dict lookup and one ``_C.run``.

``swiglu_backward`` (:func:`backward`): the Triton launcher's launch of ``_swiglu_bwd_kernel`` written once below
against a :class:`~rlk_core.ops._cuda_calls.Calls`, resolved as the JIT specialises it (the AOT variants of
:mod:`rlk_core.aot.specs_backward`) and kept per call signature as a :class:`~rlk_core.ops._cuda_calls.Program` (one
``_C.run_program``: dx allocated, the kernel launched). Launches no variant is (sizes not multiples of 16,
misaligned views) are declined: ``rlk.triton`` runs them."""

from __future__ import annotations

import functools

import torch

from rlk_core.aot.specs import TRITON_TYPE
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops.swiglu import triton as tr

KERNEL = "_swiglu_fwd_kernel"
_RECORDS = cc.records()


@functools.cache
def _variant(device: int, dtype: torch.dtype, inter: int, layout: str) -> tuple[int, int] | None:
    c = tr.config(inter)
    entry = cc.lookup(device, KERNEL, TRITON_TYPE[dtype], layout, {"BLOCK": c["BLOCK"]})
    return None if entry is None else (cc.handle(device, entry), c["BLOCK"])


def _prepare(x: torch.Tensor) -> tuple[torch.Tensor, int, str]:
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, inter, "aligned" if cc.aligned(x2, inter, x2.stride(0)) else "generic"


def _decide(key: tuple, x: torch.Tensor) -> tuple:
    said = supports_general(x)
    launch = None
    two_i = x.shape[-1]
    inter = two_i // 2
    if said[0] and two_i > 0:
        try:
            x2 = x.view(-1, two_i)  # forward_general's reshape, where it is a view (no copy)
        except RuntimeError:
            x2 = None
        if x2 is not None and x2.stride(-1) == 1 and x2.shape[0] > 0 and inter > 0:
            m = x2.shape[0]
            layout = "aligned" if cc.aligned(x2, inter, x2.stride(0)) else "generic"
            hdl, block = _variant(x.device.index, x.dtype, inter, layout)
            # launch(hdl, grid, x2, y, m, inter, x2.stride(0), y.stride(0)); y: a fresh [m, inter]
            launch = cc.Launch(hdl, (m, -(-inter // block), 1), (m, inter), (*x.shape[:-1], inter), 0,
                               layout == "aligned",
                               ((cc.T, 0), (cc.O, 0), (cc.C, m), (cc.C, inter), (cc.C, x2.stride(0)), (cc.C, inter)))
    return cc.remember(_RECORDS, key, (said, launch))


def _signature(x: torch.Tensor) -> tuple:
    """The call signature a decision is kept under: shape, strides, dtype, device, pointer alignment."""
    return (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15)


def forward(x: torch.Tensor) -> torch.Tensor:
    key = _signature(x)
    decision = _RECORDS.get(key) or _decide(key, x)
    if decision[1] is not None:
        y = cc.run(decision[1], x)
        if y is not None:
            return y
    return forward_general(x)


def supports(x: torch.Tensor) -> tuple[bool, str]:
    if cc.without_storage(x):
        return cc.NO_STORAGE
    key = _signature(x)
    return (_RECORDS.get(key) or _decide(key, x))[0]


def forward_general(x: torch.Tensor) -> torch.Tensor:
    x2, inter, layout = _prepare(x)
    m = x2.shape[0]
    y = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m > 0 and inter > 0:
        layout = layout if cc.aligned(y, y.stride(0)) else "generic"
        hdl, block = _variant(x.device.index, x.dtype, inter, layout)
        cc.launch(hdl, m, -(-inter // block), 1, x2, y, m, inter, x2.stride(0), y.stride(0))
    return y.reshape(*x.shape[:-1], inter)


def supports_general(x: torch.Tensor) -> tuple[bool, str]:
    if x.dtype not in TRITON_TYPE:
        return False, f"no AOT variant for {x.dtype}"
    x2, inter, layout = _prepare(x)
    if inter == 0:
        return False, "empty intermediate size"
    if not cc.fits_i32(x2.shape[0], x2.stride(0), x2.shape[0] * x2.shape[1]):
        return False, "sizes past int32 (the JIT's i64 variant)"
    if -(-inter // tr.config(inter)["BLOCK"]) > 65535:
        return False, f"intermediate size {inter} exceeds the grid's second dimension"
    if layout == "generic" and "swiglu" not in cc.GENERIC_BITWISE:
        return False, "operands not 16-byte aligned / sizes not multiples of 16: the JIT's own variant serves"
    if _variant(x.device.index, x.dtype, inter, layout) is None:
        return False, f"no AOT variant for I={inter} ({layout})"
    return True, ""


# -- swiglu_backward: the Triton launcher's launch (triton.backward), on a Calls -------------------------------------
def _rows(calls: cl.Calls, t: torch.Tensor):
    """``triton._rows`` of ``t`` (``[-1, last]`` with a unit last stride): ``(pointer argument, view)`` — a
    :class:`~rlk_core.ops._cuda_calls.Slice` of ``t`` where no copy is made, else the copy."""
    last = t.shape[-1]
    try:
        t2 = t.view(-1, last)  # reshape's view, where there is one
    except RuntimeError:
        t2 = calls.contiguous(t).view(-1, last)
        return t2, t2
    if t2.stride(-1) != 1:
        t2 = calls.contiguous(t2)
        return t2, t2
    return cl.Slice(t, t2), t2


def _backward(calls: cl.Calls, grad: torch.Tensor, x: torch.Tensor) -> tuple:
    two_i = x.shape[-1]
    inter = two_i // 2
    (xp, x2), (gp, g2) = _rows(calls, x), _rows(calls, grad)
    m = x2.shape[0]
    dx = calls.new(x.shape, x.dtype)  # triton: a fresh [m, 2I] reshaped to x's shape (the same contiguous tensor)
    if m > 0:
        c = tr.config(inter)
        args = cl.positional(tr._swiglu_bwd_kernel, xp, gp, cl.Slice(dx, dx.view(m, two_i)), m, inter, x2.stride(0),
                             g2.stride(0), two_i, BLOCK=c["BLOCK"])
        calls.launch(tr._swiglu_bwd_kernel, (m, -(-inter // c["BLOCK"])), args, {"num_warps": c["num_warps"]},
                     TRITON_TYPE.get(x.dtype, str(x.dtype)))
    return (dx,)


def _said_backward(grad: torch.Tensor, x: torch.Tensor) -> tuple[bool, str]:
    if grad.dtype != x.dtype:
        return False, f"grad {grad.dtype} and x {x.dtype}: only a gradient of x's dtype is built"
    return tr.supports(x)


_BACKWARD = cl.Served("swiglu_backward", _backward, _said_backward, lambda grad, x: (grad, x),
                      rebuild=lambda outs: outs[0])
backward, supports_backward = _BACKWARD.run, _BACKWARD.supports
