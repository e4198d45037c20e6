"""Emulated TP on one process (``RL_KERNEL_TP_EMULATE=t`` or ``t,sp``): the arithmetic of every rank of TP t.

A model built at real TP 1 in TP-invariant mode (``RL_KERNEL_TP_INVARIANT=G``, t a power of two dividing G) runs every
op that TP t splits as the t ranks would, one rank after the other on the one device — each rank's shard with that
rank's own op calls and shapes — and merges what the ranks exchange in process by the collectives' arithmetic:

==========================  ===========================================================================================
op                          rank r of t, and the merge
==========================  ===========================================================================================
row-parallel (o / fc2)      ``linear_tp_partials(x[..., K_r], w[:, K_r], G / t)``; the t fp32 partials merged by
                            ``rlk_collectives.merge_partials`` (the rank tree of ``all_reduce_partials``), one rounding
column-parallel (QKV, fc1)  ``linear(x, w_r)`` with the rank's local rows (``[q_r; k_r; v_r]``, ``[gate_r; up_r]``):
                            the rank's own N; the outputs put back in TP 1's column order (exact)
its input gradient          the rank's ``linear_tp_partials`` over its G / t leaves of N (``tp_grads``), merged the same
its weight gradient         the rank's ``linear(dy_r^T, x^T)``, the rows put back (exact)
core attention              RoPE and ``attention_varlen`` on the rank's query groups (its q heads, k / v heads)
q/k-norm weight gradient    the rank's head leaves' subtree, the t subtrees merged by ``merge_partials``
``,sp``: the reduce-scatter  the rows of the merge (rank r's rows: what ``reduce_scatter_partials`` gives it), the
                            all-gather their concatenation (exact); the norms' weight gradients over the ranks' token
                            leaves, merged by ``merge_partials``
==========================  ===========================================================================================

Not emulated, because TP does not change their arithmetic (``docs/ops/linear_tp.md``): the embedding (a row lookup),
the norms on replicated rows, SwiGLU and the residual adds (elementwise), the LM head and the log-probs (the
vocab-parallel ``rlk.logp.v1`` tree over 8 fixed vocab groups, independent of the shard count). What the emulation
proves is the arithmetic of every rank; what only a multi-GPU run proves is the transport and the process layout.
Nothing here computes: every floating-point operation is an rlk op or ``merge_partials``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlk_collectives import merge_partials, reduce_reference
from rlk_core import envs
from rlk_core.errors import RlkConfigError, RlkPolicyError
from rlk_megatron_provider import _compat, _state, tp_grads

Tensor = torch.Tensor
VAR = "RL_KERNEL_TP_EMULATE"


@dataclass(frozen=True)
class Emulation:
    """The emulated layout: ``tp`` ranks, sequence parallelism ``sp``, G = ``leaves_total``; ``bi``: the negative
    control (row-parallel linears under ``rlk.gemm.bi.v1`` per rank, :func:`row_parallel`)."""

    tp: int
    sp: bool
    leaves_total: int
    bi: bool = False

    @property
    def leaves(self) -> int:
        """The leaves a rank holds: G / t."""
        return self.leaves_total // self.tp


def emulation(config, tp) -> Emulation | None:
    """The run's emulation (None: off), checked against invariant mode, the real TP ``tp`` (must be 1; an int, or a
    function giving it, asked only when the variable is set), CP 1 and the model's heads; refused with one line naming
    what to change."""
    value = envs.current(VAR)
    if value is None:
        return None
    tp = tp() if callable(tp) else tp
    t, sp, bi = value
    spelled = f"{VAR}={t}{',sp' if sp else ''}{',bi' if bi else ''}"
    leaves = envs.current("RL_KERNEL_TP_INVARIANT")
    if not leaves:
        raise RlkConfigError(f"{spelled}: emulated TP runs in TP-invariant mode only: set RL_KERNEL_TP_INVARIANT=G "
                             f"(G >= {t}, a power of two) as well")
    if leaves % t:
        raise RlkConfigError(f"{spelled}: t must divide RL_KERNEL_TP_INVARIANT={leaves} (each emulated rank holds "
                             f"G / t whole leaves)")
    if tp != 1:
        raise RlkConfigError(f"{spelled}: emulation runs the t ranks in one process of a model built at TP 1, but "
                             f"the real TP is {tp}: unset {VAR} or build at TP 1")
    ps = _compat.parallel_state
    cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if cp != 1:
        raise RlkConfigError(f"{spelled}: emulated TP is covered at CP 1 only (the real CP is {cp})")
    bad = [f"{k}={getattr(config, k)}" for k in ("num_attention_heads", "num_query_groups")
           if getattr(config, k, None) and getattr(config, k) % t]
    if bad:
        raise RlkConfigError(f"{spelled}: t does not divide the model's {', '.join(bad)}")
    return Emulation(t, sp, leaves, bi)


class _Shards(torch.autograd.Function):
    """``x`` cut along ``dim`` into ``parts`` equal contiguous pieces, each a new tensor (a rank's own shard);
    backward: the pieces' gradients concatenated (exact — no zeros are added, so no sign of zero changes)."""

    @staticmethod
    def forward(ctx, x, dim, parts):
        ctx.dim = dim
        return tuple(c.clone(memory_format=torch.contiguous_format) for c in x.chunk(parts, dim))

    @staticmethod
    def backward(ctx, *grads):
        return torch.cat(grads, ctx.dim), None, None


def shards(x: Tensor, dim: int, parts: int) -> tuple[Tensor, ...]:
    if x.shape[dim] % parts:
        raise RlkPolicyError(f"rlk-megatron-provider, emulated TP {parts}: dim {dim} of shape {tuple(x.shape)} is not "
                             f"divisible by {parts}")
    return _Shards.apply(x, dim, parts)


def merge(parts: list[Tensor], em: Emulation, dtype: torch.dtype | None, leaves_total: int | None = None) -> Tensor:
    """The t ranks' fp32 partials merged in process and rounded once to ``dtype`` (fp32 when None); under ``,sp``
    rank by rank over the tokens (dim 0): rank r's rows of the reduce-scatter, concatenated (the all-gather)."""
    g = em.leaves_total if leaves_total is None else leaves_total
    if not em.sp:
        return merge_partials(parts, leaves_total=g, dtype=dtype)
    if parts[0].shape[0] % em.tp:
        raise RlkPolicyError(f"rlk-megatron-provider, emulated TP {em.tp} with sequence parallelism: "
                             f"{parts[0].shape[0]} tokens are not divisible by {em.tp}")
    rows = [p.chunk(em.tp, 0) for p in parts]
    return torch.cat([merge_partials([r[i] for r in rows], leaves_total=g, dtype=dtype) for i in range(em.tp)])


class _MergeRanks(torch.autograd.Function):
    """The row-parallel merge of the t ranks' partials (:func:`merge`); backward: every rank's fp32 partial receives
    the output gradient (the all-reduce's identity backward; under SP the all-gather of the rows' gradients)."""

    @staticmethod
    def forward(ctx, module, em, dtype, *parts):
        ctx.n = len(parts)
        with _state.get().routes.scope(module):
            return merge(list(parts), em, dtype)

    @staticmethod
    def backward(ctx, grad):
        g = grad.float()
        return (None, None, None, *(g,) * ctx.n)


class _SumRanks(torch.autograd.Function):
    """The negative control's rank sum: the t ranks' outputs (in the dtype) by the ``rlk.collective.v1`` tree
    (``rlk_collectives.reduce_reference``: what the all-reduce gives every rank); backward: the identity to each."""

    @staticmethod
    def forward(ctx, *ys):
        ctx.n = len(ys)
        return reduce_reference(ys)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) * ctx.n


def row_parallel(layer, x: Tensor) -> Tensor:
    """A row-parallel linear at emulated TP t: rank r's ``linear_tp_partials`` on its K slice of ``x`` and of the
    weight (G / t leaves), the partials merged in process, one rounding. The negative control (``,bi``): rank r's
    ``linear`` on its K slice (``rlk.gemm.bi.v1``), the t rounded outputs summed by the collective's tree — real TP t
    without invariant mode, whose bits differ from TP 1's."""
    em = layer.rlk_tp_emulate
    routes = _state.get().routes
    xs, ws = shards(x, -1, em.tp), shards(layer.weight, 1, em.tp)
    if em.bi:
        return _SumRanks.apply(*(routes.call(layer.rlk_module, "linear", xr, wr) for xr, wr in zip(xs, ws)))
    parts = [routes.call(layer.rlk_module, "linear_tp_partials", xr, wr, em.leaves) for xr, wr in zip(xs, ws)]
    return _MergeRanks.apply(layer.rlk_module, em, x.dtype, *parts)


def rank_rows(components: list[int], tp: int, device) -> tuple[list[Tensor], Tensor]:
    """Rank r's rows of a column-parallel weight whose TP 1 rows are ``components`` back to back (global sizes): every
    component's r-th of t slices, in component order (``[q_r; k_r; v_r]``); and the inverse of their concatenation
    (TP 1's row ``i`` is row ``inverse[i]`` of ``cat(rank rows)``)."""
    ranks = []
    for r in range(tp):
        rows, base = [], 0
        for c in components:
            rows.extend(range(base + r * c // tp, base + (r + 1) * c // tp))
            base += c
        ranks.append(torch.tensor(rows, dtype=torch.long, device=device))
    return ranks, torch.argsort(torch.cat(ranks))


class ColumnRanks(torch.autograd.Function):
    """A column-parallel linear at emulated TP t (TP-invariant mode): :class:`~rlk_megatron_provider.tp_grads.
    ColumnTPInvariant` run by each of the t ranks on its own rows of ``w`` (the layer's TP 1 weight in the GEMM's row
    order, e.g. ``[q; k; v]``), the outputs and the weight gradient's rows put back in TP 1's order (exact), the input
    gradient's fp32 partials merged in process (:func:`merge`) and rounded once."""

    @staticmethod
    def forward(ctx, x, w, layer):
        em = layer.rlk_tp_emulate
        ranks, inverse = layer._rlk_rank_rows(em.tp, w.device)
        routes = _state.get().routes
        ws = [w.index_select(0, rows) for rows in ranks]  # rank r's local weight, its rows in its own order
        ys = [routes.call(layer.rlk_module, "linear", x, wr) for wr in ws]
        ctx.layer, ctx.em, ctx.ranks, ctx.inverse = layer, em, ranks, inverse
        ctx.save_for_backward(x, *ws)
        return torch.cat(ys, -1).index_select(-1, inverse)

    @staticmethod
    def backward(ctx, dy):
        x, *ws = ctx.saved_tensors
        layer, em = ctx.layer, ctx.em
        routes = _state.get().routes
        g2 = dy.reshape(-1, dy.shape[-1]).to(x.dtype)
        gs = [g2.index_select(1, rows) for rows in ctx.ranks]  # rank r's output columns: its local dY
        dx = dw = None
        if ctx.needs_input_grad[0]:
            local = [c // em.tp for c in layer._rlk_components()]
            leaf = tp_grads.leaf_rows(local, em.leaves, x.device)
            parts = [routes.call(layer.rlk_module, "linear_tp_partials", g.index_select(1, leaf),
                                 w.index_select(0, leaf).t().contiguous(), em.leaves) for g, w in zip(gs, ws)]
            with routes.scope(layer.rlk_module):
                dx = merge([p.reshape(*x.shape[:-1], p.shape[-1]) for p in parts], em, x.dtype)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            dws = [routes.call(layer.rlk_module, "linear", g.t(), x2.t()).to(ws[0].dtype) for g in gs]
            dw = torch.cat(dws).index_select(0, ctx.inverse)
        return dx, dw, None


def attention_ranks(em: Emulation, q: Tensor, k: Tensor, v: Tensor, run) -> Tensor:
    """The core attention of t ranks: ``run(q_r, k_r, v_r)`` (RoPE and ``attention_varlen``) on rank r's query groups —
    its ``Hq / t`` query heads and ``Hkv / t`` key / value heads (dim -2), each a contiguous tensor — and the outputs'
    heads concatenated in rank order (TP 1's head order: Megatron's heads are group-major)."""
    outs = [run(*qkv) for qkv in zip(shards(q, -2, em.tp), shards(k, -2, em.tp), shards(v, -2, em.tp))]
    return torch.cat(outs, -2)

