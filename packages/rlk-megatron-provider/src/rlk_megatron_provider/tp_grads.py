"""TP-invariant gradients (``RL_KERNEL_TP_INVARIANT=G``): the two backward reductions that TP splits.

In a Qwen3 block every backward reduction but two runs over something TP does not split (tokens, a row's hidden
size, a head's dimension), so it has the same bits at every TP once its inputs do. The two that TP splits:

- **a column-parallel linear's input gradient** ``dX = dY W`` (QKV, fc1): a reduction over the output rows N,
  which the ranks share, summed over ranks by Megatron's ``copy_to_tensor_model_parallel_region`` backward. Under
  invariant mode it is a row-parallel GEMM of contract ``rlk.gemm.tp.v1`` over N: the rows put in leaf-major order
  (:func:`rlk_core.ops.linear_tp.column_leaf_rows`: leaf ``j`` = every component's ``j``-th of G slices, in
  component order), ``linear_tp_partials`` over the rank's G / TP leaves, ``rlk_collectives.all_reduce_partials``
  across the ranks, one rounding (:class:`ColumnTPInvariant`). The weight gradient ``dW = dY^T X`` (over the
  tokens) and the forward are ``rlk_core.ops.linear``'s, unchanged. Under sequence parallelism the input is
  all-gathered over the tokens first (exact) and the input gradient reduce-scattered by the same rank tree
  (``reduce_scatter_partials``: the rows of ``all_reduce_partials``), so SP on and off give the same bits.
- **the q/k-norm weight gradient**: the norm's weight is shared by every head, and a rank sees its own heads;
  Megatron sums the ranks' partial gradients in ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel
  _grads``, a TP all-reduce of the grads of ``q_layernorm`` / ``k_layernorm``). Under invariant mode each head's
  heads are cut into ``n = gcd(H, G)`` leaves of consecutive heads (:func:`rlk_core.ops.linear_tp.group_leaves`),
  a leaf's weight gradient is ``rms_norm_backward`` on that leaf's rows (tokens x the leaf's heads: the same rows at
  every TP), the leaves merged by the adjacent-pairs tree, across ranks by ``all_reduce_partials``
  (:class:`LeafNorm`). The merged gradient is then left on TP rank 0 and ``-0.0`` on every other rank:
  ``x + (-0.0) == x`` for every ``x`` (signed zeros and NaN included), so Megatron's TP sum that follows, in any
  order and algorithm, returns rank 0's bits exactly. (A step that skips ``finalize_model_grads`` sees the
  gradient on TP rank 0 only.)

Nothing here computes: every floating-point operation is an rlk op or an rlk collective (``docs/ops/linear_tp.md``,
"Gradients").
"""

from __future__ import annotations

import torch

import rlk_collectives
from rlk_collectives import merge_partials
from rlk_core.errors import RlkPolicyError
from rlk_core.ops import linear_tp_finish
from rlk_core.ops.linear_tp import column_leaf_rows, pairs_sum
from rlk_core.ops.rms_norm import rms_norm_backward
from rlk_megatron_provider import _state

Tensor = torch.Tensor


def _tp(group) -> tuple[int, int]:
    if group is None or group.size() == 1:
        return 1, 0
    return group.size(), group.rank()


def _merge(s: Tensor, group, leaves_total: int, dtype: torch.dtype, check: bool) -> Tensor:
    """The rank merge of fp32 partials (the top levels of the leaf tree) and the one rounding."""
    if _tp(group)[0] > 1:
        return rlk_collectives.all_reduce_partials(s, group, leaves_total=leaves_total, dtype=dtype, check=check)
    return linear_tp_finish(s, None, dtype)


def column_problems(components: list[int], leaves_total: int, tp: int) -> list[str]:
    """Why a column-parallel linear with local components ``components`` cannot take the TP-invariant input
    gradient at this TP and G (empty: it can)."""
    if tp & (tp - 1) or leaves_total % tp:
        return [f"TP {tp} is not a power of two dividing RL_KERNEL_TP_INVARIANT={leaves_total}"]
    bad = [c * tp for c in components if c % (leaves_total // tp)]
    if bad:
        return [f"the input gradient's leaves: component sizes {[c * tp for c in components]} are not all "
                f"divisible by G={leaves_total} (every component is cut into G leaves)"]
    return []


class ColumnTPInvariant(torch.autograd.Function):
    """``y = x W^T`` of a column-parallel linear (``rlk_core.ops.linear``, per output column: TP-invariant as it
    is) whose input gradient is the ``rlk.gemm.tp.v1`` row-parallel GEMM over N, merged over the TP ranks (it
    replaces Megatron's copy-to-TP region: the identity forward, the all-reduce backward). ``layer``: the rlk
    layer (its module, TP group, G and ``rlk_components``)."""

    @staticmethod
    def forward(ctx, x, w, layer):
        ctx.layer = layer
        group, tp = layer._tp_group()
        ctx.sp = bool(getattr(layer, "sequence_parallel", False)) and tp > 1
        if ctx.sp:  # sequence parallelism: the rank's tokens all-gathered (exact), dim 0
            with _state.get().routes.scope(layer.rlk_module):
                x = rlk_collectives.all_gather(x, group, dim=0, check=layer.rlk_check_collectives)
        ctx.save_for_backward(x, w)
        return _state.get().routes.call(layer.rlk_module, "linear", x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        layer = ctx.layer
        routes = _state.get().routes
        group, tp = layer._tp_group()
        g2 = dy.reshape(-1, dy.shape[-1]).to(x.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            leaves = layer.rlk_tp_leaves // tp
            rows = layer._rlk_leaf_rows(leaves, w.device)
            operands = (g2.index_select(1, rows), w.index_select(0, rows).t().contiguous())
            s = routes.call(layer.rlk_module, "linear_tp_partials", *operands, leaves) if tp > 1 else None
            with routes.scope(layer.rlk_module):
                if s is None:  # TP 1: the whole tree and the one rounding in one op (partial + finish's bits)
                    dx = routes.call(layer.rlk_module, "linear_tp", *operands, None, leaves).reshape(x.shape)
                elif ctx.sp:  # the same rank tree, reduce-scattered over the tokens: the rank's rows of the merge
                    dx = rlk_collectives.reduce_scatter_partials(
                        s.reshape(*x.shape[:-1], s.shape[-1]), group, 0, leaves_total=layer.rlk_tp_leaves,
                        dtype=x.dtype, check=layer.rlk_check_collectives)
                else:
                    dx = _merge(s, group, layer.rlk_tp_leaves, x.dtype, layer.rlk_check_collectives).reshape(x.shape)
        if ctx.needs_input_grad[1]:  # dW = dY^T X over the tokens: rlk_core.ops.linear's backward GEMM
            x2 = x.reshape(-1, x.shape[-1])
            dw = routes.call(layer.rlk_module, "linear", g2.t(), x2.t()).to(w.dtype)
        return dx, dw, None


def leaf_rows(components: list[int], leaves: int, device) -> Tensor:
    return torch.tensor(column_leaf_rows(components, leaves), dtype=torch.long, device=device)


class LeafNorm(torch.autograd.Function):
    """RMSNorm (``rms_norm`` over the last dim, weight ``[d]``) whose weight gradient is a leaf tree: ``x``'s dim
    ``dim`` cut into ``leaves`` equal leaves (this rank's; ``leaves_total`` in all), one ``rms_norm_backward`` per
    leaf (its rows: the same at every TP), the leaves merged by the adjacent-pairs tree in fp32 and, where ``group``
    is given, across its ranks by ``all_reduce_partials`` — then left on rank 0 and ``-0.0`` elsewhere (module
    docstring). The input gradient is ``rms_norm``'s, per row. q/k norms: ``dim=-2`` (heads), ``leaves_total =
    gcd(H, G)``; a norm over tokens: ``dim=0``, ``leaves_total = gcd(T, G)`` (sequence parallelism: the rank's share,
    merged over the TP group; without it, all of them on every rank)."""

    @staticmethod
    def forward(ctx, x, w, eps, module, dim, leaves, leaves_total, group, check, ranks=1):
        if x.shape[dim] % leaves or leaves % ranks:  # group_leaves makes these divide; a caller that does not: a bug
            raise RlkPolicyError(f"rlk-megatron-provider, module {module!r}, TP-invariant mode: dim {dim} of the "
                                 f"norm's input (shape {tuple(x.shape)}) does not divide into {leaves} leaves "
                                 f"over {ranks} ranks")
        ctx.args = (eps, module, dim, leaves, leaves_total, group, check, ranks)
        ctx.save_for_backward(x, w)
        return _state.get().routes.call(module, "rms_norm", x, w, eps)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        eps, module, dim, leaves, leaves_total, group, check, ranks = ctx.args
        routes = _state.get().routes
        tp, rank = _tp(group)
        size = x.shape[dim] // leaves
        dxs, parts = [], []
        with routes.scope(module):
            for j in range(leaves):
                dx_l, dw_l = rms_norm_backward(dy.narrow(dim, j * size, size).contiguous(),
                                      x.narrow(dim, j * size, size).contiguous(), w, eps)
                dxs.append(dx_l)
                parts.append(dw_l.float())
            if ranks > 1:  # emulated TP: each emulated rank's subtree, merged in process by the rank tree
                n = leaves // ranks
                dw = merge_partials([pairs_sum(parts[r * n:(r + 1) * n]) for r in range(ranks)],
                                    leaves_total=leaves_total, dtype=w.dtype)
            else:
                dw = _merge(pairs_sum(parts), group, leaves_total, w.dtype, check)
        if tp > 1 and rank:  # Megatron's TP sum (finalize_model_grads) then returns rank 0's bits exactly
            dw = torch.full_like(dw, -0.0)
        return torch.cat(dxs, dim=dim), dw, None, None, None, None, None, None, None, None


def leaf_norm(x: Tensor, w: Tensor, eps: float, module: str, *, dim: int, leaves_total: int, group,
              check: bool, ranks: int = 1) -> Tensor:
    """:class:`LeafNorm` with this rank's share of ``leaves_total`` leaves (all of them where ``group`` is None).
    ``ranks`` > 1 (emulated TP, ``group`` None): the leaves are those of ``ranks`` ranks in rank order, each rank's
    subtree summed and the subtrees merged by ``rlk_collectives.merge_partials``."""
    tp, _ = _tp(group)
    return LeafNorm.apply(x, w, eps, module, dim, leaves_total // tp, leaves_total, group, check, ranks)
