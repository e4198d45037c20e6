"""A whole new op in one file — ``example_scale_rows(x, s)[i, j] = x[i, j] * s[i]`` in fp32, rounded once to x's
dtype — to show what adding a kernel takes (``tests/core/test_one_file_op.py``): its Triton kernel, its launch plan,
the calls the AOT build compiles it for, its check, its reference, and one line that registers ``rlk.triton`` and
``rlk.cuda``. Nothing in rlk-core names it: the AOT build finds it as a family, rlk.cuda serves it from the
manifest and replays it from C++ on repeats, with no launcher of its own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_core.backends import REGISTRY, Backend
from rlk_core.contracts import OP_CONTRACTS
from rlk_core.ops._backends import register_kernel_backends
from rlk_core.ops._dispatch import define
from rlk_core.ops._plan import next_pow2

OP = "example_scale_rows"
# its contract id: a product op's is a line of rlk_core/contracts.py's table (the reviewed vocabulary of contracts,
# not launch code); this example brings its own
OP_CONTRACTS[OP] = "rlk.example_scale_rows.v1"


@triton.jit(do_not_specialize=["N", "stride_x"])  # one binary per block size, whatever the row length
def _scale_rows_kernel(x_ptr, s_ptr, y_ptr, N, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + row)
    tl.store(y_ptr + row * N + cols, (x * s).to(y_ptr.dtype.element_ty), mask=mask)


def forward(p, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The launch plan: one program per row and block of columns."""
    y = p.new(x.shape, x.dtype)
    block = min(1024, next_pow2(x.shape[1]))
    p.launch(_scale_rows_kernel, (x.shape[0], triton.cdiv(x.shape[1], block)), x, s, y, x.shape[1], x.stride(0),
             BLOCK=block)
    return y


def supports(x: torch.Tensor, s: torch.Tensor) -> tuple[bool, str]:
    return True, ""


def build_calls(dtype: torch.dtype, sms: int):
    """What the AOT build compiles: one call per block size the plan picks (16 ... 1024)."""
    for n in (16 << i for i in range(7)):
        yield forward, (torch.empty((8, n), dtype=dtype, device="meta"), torch.empty(8, device="meta"))


def reference(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.float() * s[:, None]).to(x.dtype)


@define(OP)
def example_scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1 or s.shape != (x.shape[0],) or s.dtype != torch.float32:
        raise ValueError(f"{OP}: x must be a row-major [M, N] tensor and s float32 [M], got {tuple(x.shape)}, "
                         f"{tuple(s.shape)} {s.dtype}")


@example_scale_rows.register_fake
def _(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


REGISTRY.register(Backend("rlk.reference", OP, reference, devices=("cpu", "cuda"), builtin=True))
register_kernel_backends(OP, f"{__name__}:forward", f"{__name__}:supports")
