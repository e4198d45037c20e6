"""``all_reduce``, ``reduce_scatter`` and ``all_gather`` under contract ``rlk.collective.v1``.

Contract ``rlk.collective.v1``: for a group of ``W`` ranks the reduced value of every element is
``round_to_dtype(tree_sum_fp32(x_0, ..., x_{W-1}))`` — the inputs widened to fp32, added in one fixed
pairwise tree over rank order (``(x_0 + x_1) + (x_2 + x_3)``; an odd last term is carried up), rounded
once — whatever the message size, the chunking, the transport's algorithm, the number of elements, or
which framework asks. All-gather is exact data movement. Every ``W >= 1`` is supported; the dtypes
reduced are bfloat16, float16 and float32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from rlk_collectives import _transport as T
from rlk_collectives._group import Group, check_agreement, check_local, resolve
from rlk_collectives._tree import reduce_rows
from rlk_core.contracts import COLLECTIVE_CONTRACT
from rlk_core.readback import note_op_call

CONTRACT_ID = COLLECTIVE_CONTRACT
BACKEND_ID = "rlk.collectives.torch_distributed"

Tensor = torch.Tensor


_NO_RANGE = contextlib.nullcontext()


def _traced(op: str) -> contextlib.AbstractContextManager[object]:
    """``rlk.collective.<op>``, a profiler range, while a profiler runs (``rlk-repro run --trace``: the kernels inside
    are the collective's, rlk_validate.kernel_trace); nothing otherwise."""
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"rlk.collective.{op}")
    return _NO_RANGE


def _capturing(x: Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def prepare(op: str, x: Tensor, group: dist.ProcessGroup | None, check: bool, *, dim: int = 0, digest: int = 0,
            reduces: bool = True, dim_rule: str = "none") -> Group:
    """Resolve the group, validate (exchanging metadata when ``check``), report the call."""
    g = resolve(group, op)
    if check and not _capturing(x):
        check_agreement(op, x, g, dim, digest, reduces, dim_rule)
    else:
        check_local(op, x, g, dim, reduces, dim_rule)
    note_op_call(op, BACKEND_ID, CONTRACT_ID, None, "graph" if _capturing(x) else "eager",
                 {"world_size": g.size})
    return g


def _wants_grad(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


# -- the collectives without autograd --------------------------------------------------------------
def _all_reduce(x: Tensor, g: Group, path: str | None = None) -> Tensor:
    flat = x.reshape(-1).contiguous()
    if g.size == 1 or flat.numel() == 0:
        return reduce_rows(flat.view(1, -1)).view(x.shape)
    return T.all_reduce_flat(flat, g, path).view(x.shape)


def _reduce_scatter(x: Tensor, g: Group, dim: int) -> Tensor:
    xm = x.movedim(dim, 0)
    rows = xm.shape[0] // g.size
    stack = xm.contiguous().view(g.size, xm.numel() // g.size)
    if g.size == 1 or stack.numel() == 0:
        mine = reduce_rows(stack)
    else:
        mine = T.reduce_scatter_rows(stack, g)
    return mine.view(rows, *xm.shape[1:]).movedim(0, dim).contiguous()


def _all_gather(x: Tensor, g: Group, dim: int) -> Tensor:
    xm = x.movedim(dim, 0).contiguous()
    if g.size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    out = T.all_gather_flat(xm.view(-1), g) if xm.numel() else xm.new_empty(0)
    return out.view(g.size * xm.shape[0], *xm.shape[1:]).movedim(0, dim).contiguous()


# -- autograd: each backward is the collective the forward's math requires ------------------------
class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, path):
        ctx.g = g
        return _all_reduce(x, g, path)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.g), None, None


def adjoint_pair(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function computing ``forward(x, *args)`` whose backward is ``backward(grad, *args)`` — a
    collective and its adjoint (reduce-scatter and all-gather, each the other's backward)."""
    def fwd(ctx, x, *args):
        ctx.args = args
        return forward(x, *args)

    def bwd(ctx, grad):
        return (backward(grad, *ctx.args), *(None,) * len(ctx.args))

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_ReduceScatter = adjoint_pair("_ReduceScatter", _reduce_scatter, _all_gather)
_AllGather = adjoint_pair("_AllGather", _all_gather, _reduce_scatter)


# -- public -----------------------------------------------------------------------------------------
def all_reduce(x: Tensor, group: dist.ProcessGroup | None = None, *, check: bool = True,
               _path: str | None = None) -> Tensor:
    """Deterministic all-reduce (sum) under contract ``rlk.collective.v1``; returns a new tensor.

    Every element of the result, on every rank, is ``round_to_dtype(tree_sum_fp32(x_0, ..., x_{W-1}))``:
    the ranks' inputs widened to fp32, added in one fixed pairwise tree over rank order, rounded once —
    whatever the message size, chunking or transport algorithm. The result depends only on the set of
    rank contributions (in rank order).

    Parameters
    ----------
    x : tensor of any shape and strides, bfloat16, float16 or float32; the same shape and dtype on every
        rank of ``group``.
    group : the process group (default: the world); the caller must be a member. Any size ``W >= 1``.
    check : exchange shape/dtype metadata first, so that bad input raises the same
        :class:`~rlk_core.errors.RlkInputError` on every rank (one small collective and a host read).
        Skipped under CUDA graph capture. With ``False`` only this rank's own input is checked.

    Returns
    -------
    A contiguous tensor of ``x``'s shape and dtype. Autograd: the gradient of ``x`` is this all-reduce
    of the output gradients (each rank's output is a function of every rank's input).
    """
    with _traced("all_reduce"):
        g = prepare("all_reduce", x, group, check)
        if _wants_grad(x):
            return _AllReduce.apply(x, g, _path)
        return _all_reduce(x, g, _path)


def reduce_scatter(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = 0, *, check: bool = True) -> Tensor:
    """Deterministic reduce-scatter (sum) under contract ``rlk.collective.v1``.

    ``x`` is cut along ``dim`` into ``W`` equal chunks; rank ``r`` receives chunk ``r`` reduced over the
    ranks: every element is ``round_to_dtype(tree_sum_fp32(x_0, ..., x_{W-1}))``, the same tree and
    rounding as :func:`all_reduce`, so ``cat(reduce_scatter(x) over ranks, dim) == all_reduce(x)`` bitwise.

    Parameters
    ----------
    x : bfloat16, float16 or float32, the same shape on every rank; ``x.shape[dim]`` divisible by ``W``.
    group, check : as for :func:`all_reduce`.
    dim : the dimension to scatter (sequence parallelism: the token dimension).

    Returns
    -------
    A contiguous tensor, ``x.shape`` with ``shape[dim] / W``. Autograd: the gradient of ``x`` is the
    :func:`all_gather` of the output gradients along ``dim``.
    """
    with _traced("reduce_scatter"):
        g = prepare("reduce_scatter", x, group, check, dim=dim, dim_rule="divisible")
        dim = dim % x.dim()
        if _wants_grad(x):
            return _ReduceScatter.apply(x, g, dim)
        return _reduce_scatter(x, g, dim)


def all_gather(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = 0, *, check: bool = True) -> Tensor:
    """All-gather along ``dim``: exact data movement, ``cat([x_0, ..., x_{W-1}], dim)`` on every rank.

    Part of contract ``rlk.collective.v1`` so both frameworks use one layout rule (rank order along
    ``dim``). Any dtype; the same shape on every rank.

    Returns
    -------
    A contiguous tensor, ``x.shape`` with ``shape[dim] * W``. Autograd: the gradient of ``x`` is the
    deterministic :func:`reduce_scatter` of the output gradients along ``dim``.
    """
    with _traced("all_gather"):
        g = prepare("all_gather", x, group, check, dim=dim, reduces=False, dim_rule="range")
        if x.dim() == 0:
            x = x.reshape(1)
        dim = dim % x.dim()
        if _wants_grad(x):
            return _AllGather.apply(x, g, dim)
        return _all_gather(x, g, dim)
