"""The rank merge of contract ``rlk.gemm.tp.v1``: fp32 partials all-reduced / reduce-scattered by the rank tree.

A TP-invariant row-parallel GEMM (``rlk_core.ops.linear_tp_partials``, ``docs/ops/linear_tp.md``) leaves on each of
the W ranks the fp32 subtree of the G / W leaves it holds. The top log2(W) levels of the leaf tree are
``rlk.collective.v1``'s rank tree — adjacent pairs over rank order — on those fp32 partials, where it adds and does
not round; :func:`all_reduce_partials` runs exactly that (the all-reduce's transport and tree, fp32 on the wire) and
then, when asked for a dtype, the one rounding of the contract (``rlk_core.ops.linear_tp_finish``: bias in fp32,
round once, canonical NaN). :func:`reduce_scatter_partials` is the same per element for sequence parallelism, so
``cat(reduce_scatter_partials(s) over ranks, dim) == all_reduce_partials(s)`` bitwise; the all-gather after it is
``rlk_collectives.all_gather`` (exact). TP 1, 2, 4, ..., G then give the same bits.

W must be a power of two dividing G (then every rank's leaves form one aligned subtree); G is the same on every rank
(exchanged with the rank-agreement check as the layout digest) and recorded in the readback (``leaves_total``).

:func:`merge_partials` is the same merge in one process — the W ranks' partials given as a list — for emulated TP
(``RL_KERNEL_TP_EMULATE``, the Megatron provider): the rank tree of :func:`_tree.reduce_rows` that every rank of
:func:`all_reduce_partials` runs on the gathered partials, with the same checks and the same rounding, no transport.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlk_collectives import _ops
from rlk_collectives._group import Group, check_agreement, check_local, resolve
from rlk_collectives._tree import reduce_rows
from rlk_core.errors import RlkInputError
from rlk_core.readback import note_op_call
from rlk_core.tp import DEFAULT_LEAVES

Tensor = torch.Tensor


def _prepare(op: str, public: str, s: Tensor, group: dist.ProcessGroup | None, check: bool, leaves_total: int,
             dim: int = 0, dim_rule: str = "none") -> Group:
    g = resolve(group, public)
    if not isinstance(leaves_total, int) or isinstance(leaves_total, bool) or leaves_total < 1:
        raise RlkInputError(f"rlk_collectives.{public}: leaves_total (G) must be a positive int, got {leaves_total!r}")
    # the agreement first, with G as the layout digest: then every rank sees the same G, dtype and shape, and the
    # checks below raise on every rank or on none
    if check and not _ops._capturing(s):
        check_agreement(op, s, g, dim, leaves_total, True, dim_rule)
    else:
        check_local(op, s, g, dim, True, dim_rule)
    found = _problems(s.dtype, g.size, leaves_total)
    if found:
        raise RlkInputError(f"rlk_collectives.{public} (rank {g.rank} of {g.size}): " + " | ".join(found))
    note_op_call(op, _ops.BACKEND_ID, _ops.CONTRACT_ID, None, "graph" if _ops._capturing(s) else "eager",
                 {"world_size": g.size, "leaves_total": leaves_total, "partials": "rlk.gemm.tp.v1"})
    return g


def _problems(dtype: torch.dtype, size: int, leaves_total: int) -> list[str]:
    """What the partials' dtype, the rank count and G do not allow (empty: they are fine)."""
    found = []
    if dtype != torch.float32:
        found.append(f"the partials must be float32 (rlk.gemm.tp.v1 moves fp32 partials), got {dtype}")
    if leaves_total & (leaves_total - 1):
        found.append(f"leaves_total (G) must be a power of two, got {leaves_total}")
    if size & (size - 1) or leaves_total % size:
        found.append(f"the group size {size} must be a power of two dividing G={leaves_total} (each rank holds "
                     f"G / TP whole leaves); raise G (RL_KERNEL_TP_INVARIANT) or use such a TP")
    return found


def _finish(out: Tensor, bias: Tensor | None, dtype: torch.dtype | None) -> Tensor:
    if dtype is None:
        if bias is not None:
            raise RlkInputError("rlk_collectives: a bias is added by the final rounding; pass dtype with it")
        return out
    from rlk_core.ops import linear_tp_finish  # the op package only where a rounding is asked for

    return linear_tp_finish(out, bias, dtype)


def all_reduce_partials(s: Tensor, group: dist.ProcessGroup | None = None, *, leaves_total: int = DEFAULT_LEAVES,
                        bias: Tensor | None = None, dtype: torch.dtype | None = None, check: bool = True) -> Tensor:
    """The rank merge of ``rlk.gemm.tp.v1``: the fp32 partials of the W ranks added by the rank tree, in fp32.

    Parameters
    ----------
    s : float32 tensor, the same shape on every rank — this rank's ``linear_tp_partials(x_r, w_r, G / W)``.
    group : the TP group (default: the world); its size W a power of two dividing ``leaves_total``.
    leaves_total : G, the run's leaf count (the same on every rank; exchanged and checked).
    bias, dtype : with ``dtype``, the result is ``linear_tp_finish(merged, bias, dtype)`` — the contract's one
        rounding; without, the merged fp32 partial (``bias`` needs ``dtype``).
    check : as for :func:`rlk_collectives.all_reduce`.

    Returns
    -------
    A contiguous tensor of ``s``'s shape: fp32, or ``dtype``. Equal on every rank, and for every W dividing G equal to
    ``linear_tp(x, w, bias, G)`` computed on one process. Autograd: as :func:`rlk_collectives.all_reduce` (the
    gradient is the all-reduce of the output gradients), then through the rounding.
    """
    g = _prepare("all_reduce", "all_reduce_partials", s, group, check, leaves_total)
    out = _ops._AllReduce.apply(s, g, None) if _ops._wants_grad(s) else _ops._all_reduce(s, g)
    return _finish(out, bias, dtype)


def reduce_scatter_partials(s: Tensor, group: dist.ProcessGroup | None = None, dim: int = 0, *,
                            leaves_total: int = DEFAULT_LEAVES, bias: Tensor | None = None,
                            dtype: torch.dtype | None = None, check: bool = True) -> Tensor:
    """:func:`all_reduce_partials` reduce-scattered along ``dim`` (sequence parallelism: the token dimension).

    Rank ``r`` receives chunk ``r`` of ``dim`` of the merged partial — every element the same rank tree in fp32 as
    :func:`all_reduce_partials`, then the same rounding when ``dtype`` is given — so the all-gather of the results
    (:func:`rlk_collectives.all_gather`, exact) is ``all_reduce_partials(s)`` bitwise: SP on and off, the same bits.
    ``s.shape[dim]`` must be divisible by W. Autograd: as :func:`rlk_collectives.reduce_scatter`.
    """
    g = _prepare("reduce_scatter", "reduce_scatter_partials", s, group, check, leaves_total, dim, "divisible")
    dim = dim % s.dim()
    out = _ops._ReduceScatter.apply(s, g, dim) if _ops._wants_grad(s) else _ops._reduce_scatter(s, g, dim)
    return _finish(out, bias, dtype)


IN_PROCESS_BACKEND_ID = "rlk.collectives.in_process"


def merge_partials(parts: Sequence[Tensor], *, leaves_total: int = DEFAULT_LEAVES, bias: Tensor | None = None,
                   dtype: torch.dtype | None = None) -> Tensor:
    """:func:`all_reduce_partials` of W ranks computed in one process (emulated TP): no transport, the same bits.

    Parameters
    ----------
    parts : the W ranks' fp32 partials in rank order (``linear_tp_partials(x_r, w_r, G / W)``), one shape; W a power
        of two dividing ``leaves_total``.
    leaves_total, bias, dtype : as for :func:`all_reduce_partials`.

    Returns
    -------
    A new contiguous tensor of the parts' shape: the rank tree (``(x_0 + x_1) + (x_2 + x_3)``, adjacent pairs over
    rank order, fp32 — :func:`rlk_collectives._tree.reduce_rows`, what every rank of :func:`all_reduce_partials`
    runs on the gathered partials), then ``linear_tp_finish`` when ``dtype`` is given. The rows of the result along
    any dimension are what :func:`reduce_scatter_partials` gives each rank. No autograd (the parts are detached).
    Reported to the readback as ``merge_partials`` (backend ``rlk.collectives.in_process``, ``emulated: True``).
    """
    parts = list(parts)
    if not parts or any(not isinstance(p, torch.Tensor) for p in parts):
        raise RlkInputError("rlk_collectives.merge_partials: parts must be a non-empty list of tensors (rank order)")
    shape = parts[0].shape
    found = _problems(parts[0].dtype, len(parts), leaves_total) if isinstance(leaves_total, int) else [
        f"leaves_total (G) must be a positive int, got {leaves_total!r}"]
    bad = [i for i, p in enumerate(parts) if p.shape != shape or p.dtype != parts[0].dtype]
    if bad:
        found.append(f"every part must have part 0's shape {tuple(shape)} and dtype {parts[0].dtype}; part {bad[0]} "
                     f"is {tuple(parts[bad[0]].shape)} {parts[bad[0]].dtype}")
    if found:
        raise RlkInputError(f"rlk_collectives.merge_partials ({len(parts)} ranks): " + " | ".join(found))
    note_op_call("merge_partials", IN_PROCESS_BACKEND_ID, _ops.CONTRACT_ID, None, "eager",
                 {"world_size": len(parts), "leaves_total": leaves_total, "partials": "rlk.gemm.tp.v1",
                  "emulated": True})
    stack = torch.stack([p.detach().reshape(-1) for p in parts])
    return _finish(reduce_rows(stack).view(shape), bias, dtype)
