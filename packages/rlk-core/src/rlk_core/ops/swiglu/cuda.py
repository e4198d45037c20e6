"""``swiglu`` on ``rlk.cuda``: ``rlk.triton``'s kernel (:mod:`rlk_core.ops.swiglu.triton`) from its AOT cubin,
launched by ``rlk_core._C``. Same preparation, config and grid as the Triton launcher."""

from __future__ import annotations

import functools

import torch

from rlk_core.aot.specs import TRITON_TYPE
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops.swiglu import triton as tr

KERNEL = "_swiglu_fwd_kernel"


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


def forward(x: torch.Tensor) -> torch.Tensor:
    x2, inter, layout = _prepare(x)
    m = x2.shape[0]
    y = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m > 0 and inter > 0:
        layout = layout if cc.aligned(y, y.stride(0)) else "generic"
        hdl, block = _variant(x.device.index, x.dtype, inter, layout)
        from rlk_core import _C

        _C.launch(hdl, m, -(-inter // block), 1, x2, y, m, inter, x2.stride(0), y.stride(0))
    return y.reshape(*x.shape[:-1], inter)


def supports(x: torch.Tensor) -> tuple[bool, str]:
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
