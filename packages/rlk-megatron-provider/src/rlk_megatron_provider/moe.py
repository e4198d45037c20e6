"""The MoE layer on rlk ops (issue 36; the ``ffn`` module's MoE form, contract ``rlk.moe.v1``, docs/ops/moe.md).

Three classes stand in for megatron-core's, in the slots of its ``MoELayer`` spec:

============================  ==========================  ==================================================
slot                          stock                       rlk
============================  ==========================  ==================================================
``MoESubmodules.router``      ``TopKRouter``              :class:`RlkTopKRouter`: the router GEMM (``linear``)
                                                          and ``moe_topk``; the stock z-loss and load-balancing
                                                          losses attached as Megatron attaches them
``MoESubmodules.experts``     ``GroupedMLP`` /            :class:`RlkGroupedExperts`: ``GroupedMLP``'s
                              ``SequentialMLP``           parameters (``weight1``, ``weight2``), the experts on
                                                          ``moe_grouped_linear`` around ``swiglu``
the layer                     ``MoELayer``                :class:`RlkMoELayer`: route, dispatch, experts and the
                                                          slot-order ``moe_combine``
============================  ==========================  ==================================================

Why the layer's forward is rlk's and not the stock one with rlk experts: Megatron's combine is arithmetic — the
experts scale their rows by the probabilities (in the rows' dtype), ``unpermute`` ``scatter_add``-s them into the
token, the all-gather dispatcher reduce-scatters partial outputs across EP ranks — a rounding per contribution in
an order that depends on the dispatch. rlk keeps the router's ``[T, k]`` weights and sums a token's k unweighted
expert outputs in slot order in fp32, once (``moe_combine``), whatever rank computed them.

Expert parallelism (EP > 1) is data movement only, through ``torch.distributed`` on the EP group: each rank
all-gathers the tokens and their expert ids (exact), computes the pairs of its local experts, and the pairs' output
rows are exchanged by an all-reduce of a ``[T_all * k, H]`` slot buffer in which every row has exactly one rank's
non-zero contribution (``x + 0 = x``: exact, in any reduction order); the backward is the mirror image (the slot
gradients gathered, the pairs' input gradients exchanged the same way and summed per token by ``moe_combine``), so
the bits of the log-probs and of every gradient do not depend on EP. The stock token dispatcher is built (the
``MoELayer`` constructor builds it) but not called: its combine is the arithmetic above. The exchange moves
``k`` times a reduce-scatter's bytes; a dispatcher that moves only the pairs (all-to-all) is the next step.

Tensor parallelism (TP > 1) at EP 1, expert TP 1: every TP rank holds the TP group's tokens and the whole experts
and runs the layer as at TP 1 (replicated, like a norm): no MoE arithmetic is split, so TP changes no bit of it;
the attention around it needs the provider's TP-invariant mode for TP 1's bits. TP > 1 with EP > 1 is refused (the
EP group's TP-replicated tokens would each reach the experts TP times: sequence parallelism's token split first),
and so is sequence parallelism.

The aux / z losses change no forward value: ``MoEAuxLossAutoScaler`` returns its input and adds the loss's gradient
in the backward; with the coefficients set, log-probs are the same bits (``tests/megatron/test_moe_layer.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from rlk_core import envs
from rlk_core.errors import RlkPolicyError
from rlk_core.ops import moe_combine
from rlk_core.ops.moe import layer as moe_layer
from rlk_megatron_provider import _compat, _state
from rlk_megatron_provider.layers import _RlkLayer

Tensor = torch.Tensor
_M = _compat.moe()


def moe_problems(config) -> list[str]:
    """Why a config's MoE layers cannot run the rlk route (empty: they can)."""
    out = []
    tp, ep = getattr(config, "tensor_model_parallel_size", 1), getattr(config, "expert_model_parallel_size", 1) or 1
    checks = (
        (getattr(config, "moe_router_score_function", "softmax") != "softmax", "a router score function other than "
         "softmax"),
        (getattr(config, "moe_router_num_groups", None), "group-limited routing (moe_router_num_groups)"),
        (getattr(config, "moe_router_topk_scaling_factor", None), "moe_router_topk_scaling_factor"),
        (getattr(config, "moe_router_enable_expert_bias", False), "an expert bias (moe_router_enable_expert_bias)"),
        (getattr(config, "moe_expert_capacity_factor", None) is not None, "token dropping (a capacity factor)"),
        (getattr(config, "moe_shared_expert_intermediate_size", None), "shared experts (not built yet)"),
        (getattr(config, "moe_input_jitter_eps", None), "router input jitter"),
        (getattr(config, "moe_router_force_load_balancing", False), "moe_router_force_load_balancing"),
        (getattr(config, "moe_latent_size", None), "MoE latent projections"),
        (getattr(config, "moe_apply_probs_on_input", False), "moe_apply_probs_on_input"),
        (tp != 1 and ep != 1, f"TP {tp} with EP {ep} in an MoE model (the TP ranks' tokens are the same: every one "
         "would reach the experts TP times)"),
        (tp != 1 and getattr(config, "sequence_parallel", False), "sequence parallelism in an MoE model"),
        (getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1), "expert tensor parallelism"),
        (getattr(config, "router_replay", None), "router replay"),
    )
    out += [f"MoE: {what} is not covered" for bad, what in checks if bad]
    return out


class RlkTopKRouter(_RlkLayer, _M.TopKRouter):
    """``TopKRouter`` (its ``weight [E, H]``, state-dict keys and loss bookkeeping) whose forward is rlk's:
    ``logits = linear(x, weight)`` in x's dtype, then ``moe_topk`` — the fp32 softmax, top-k with ties to the lower
    expert id, renormalised where Megatron's ``moe_router_pre_softmax`` is off (softmax over the k: Qwen3-MoE's
    ``norm_topk_prob``). Returns ``(weights fp32 [T, k], ids int64 [T, k])`` instead of Megatron's dense ``[T, E]``
    probabilities and routing map."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rlk_setup("ffn", moe_problems(self.config))

    @property
    def normalize(self) -> bool:
        return not self.config.moe_router_pre_softmax

    def forward(self, input: Tensor, padding_mask: Tensor | None = None):
        if not self.rlk_active:
            raise RlkPolicyError("rlk-megatron-provider, module 'ffn': RlkTopKRouter runs only where ffn is R")
        routes = _state.get().routes
        seq, bsz = input.shape[0], (input.shape[1] if input.dim() == 3 else 1)
        x = input.reshape(-1, input.shape[-1])
        mask = padding_mask.reshape(-1) if padding_mask is not None else None
        logits = routes.call("ffn", "linear", x, self.weight.to(x.dtype))
        logits = self.apply_z_loss(logits, padding_mask=mask)  # the value unchanged (a gradient in the backward)
        weights, ids = routes.call("ffn", "moe_topk", logits, self.topk, self.normalize)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            # the stock losses, attached to the weights as Megatron attaches them to its probs (values unchanged)
            aux_map, scores = _M.compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function,
                                                                     fused=False, padding_mask=mask)
            flag = mask is not None
            weights = self._apply_aux_loss(weights, scores, aux_map, with_padding_mask=flag)
            weights = self._apply_seq_aux_loss(weights, scores, aux_map, seq, bsz, with_padding_mask=flag)
            weights = self._apply_global_aux_loss(weights, scores, aux_map, with_padding_mask=flag)
        return weights, ids


class RlkGroupedExperts(_RlkLayer, _M.MegatronModule):
    """The local experts with ``GroupedMLP``'s parameters and state-dict keys: ``weight1 [H, E_l*2I]`` (the memory of
    ``[E_l, H, 2I]``: expert ``e``'s ``[gate; up]^T``) and ``weight2 [E_l*I, H]`` (``[E_l, I, H]``), seen by the rlk
    ops as ``w13 [E_l, 2I, H]`` / ``w2 [E_l, H, I]`` (views, no copy). Expert TP 1."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, **kwargs):
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        h, i = config.hidden_size, config.moe_ffn_hidden_size
        self.weight1 = torch.nn.Parameter(torch.empty(h, num_local_experts * 2 * i, dtype=config.params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts * i, h, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight1)
                config.output_layer_init_method(self.weight2)
        expert_parallel = config.expert_model_parallel_size > 1
        for w in (self.weight1, self.weight2):
            w.allreduce = not expert_parallel  # Megatron's marker: EP-sharded parameters skip the DP all-reduce
        self._rlk_setup("ffn", moe_problems(config))

    def w13(self) -> Tensor:
        n, h = self.num_local_experts, self.config.hidden_size
        return self.weight1.view(n, h, -1).transpose(1, 2)

    def w2(self) -> Tensor:
        n, h = self.num_local_experts, self.config.hidden_size
        return self.weight2.view(n, -1, h).transpose(1, 2)

    def forward(self, x: Tensor, offsets: Tensor) -> Tensor:
        """``x [M, H]`` rows grouped by local expert (``offsets [E_l + 1]``) -> ``[M, H]`` unweighted outputs."""
        routes = _state.get().routes
        h = routes.call("ffn", "moe_grouped_linear", x, self.w13().to(x.dtype), offsets)
        return routes.call("ffn", "moe_grouped_linear", routes.call("ffn", "swiglu", h), self.w2().to(x.dtype),
                           offsets)


class _DispatchEP(torch.autograd.Function):
    """EP dispatch: the EP group's tokens all-gathered (exact; ranks may hold different counts), this rank's sorted
    pair rows taken from them. Backward: each sorted row's gradient placed at its (token, slot) pair in a ``[P_all,
    H]`` buffer (zeros elsewhere) summed over the group — one non-zero contribution per row, so exact in any order —
    then this rank's tokens' k slot gradients summed in slot order by ``moe_combine``: EP 1's dispatch backward."""

    @staticmethod
    def forward(ctx, x, tok, where, counts, top_k, group):
        ctx.save_for_backward(where)
        ctx.counts, ctx.top_k, ctx.group = counts, top_k, group
        return _gather_rows(x, counts, group).index_select(0, tok)

    @staticmethod
    def backward(ctx, grad):
        (where,) = ctx.saved_tensors
        counts, k, rank = ctx.counts, ctx.top_k, ctx.group.rank()
        buf = grad.new_zeros((sum(counts) * k, grad.shape[1]))
        buf.index_copy_(0, where, grad)
        dist.all_reduce(buf, group=ctx.group)
        start = sum(counts[:rank])
        mine = buf.view(-1, k, grad.shape[1])[start:start + counts[rank]]
        return moe_combine(mine, mine.new_ones(mine.shape[:2], dtype=torch.float32)), None, None, None, None, None


class _CombineEP(torch.autograd.Function):
    """EP un-dispatch: this rank's sorted pair rows placed at their pairs of a ``[P_all, H]`` buffer (zeros
    elsewhere) summed over the group (one contribution per row: exact), this rank's tokens' ``[T, k, H]`` slots
    returned. Backward: the slot gradients (each on its token's rank only) summed over the group the same way, each
    rank's pair rows taken."""

    @staticmethod
    def forward(ctx, rows, where, counts, top_k, group):
        ctx.save_for_backward(where)
        ctx.counts, ctx.top_k, ctx.group = counts, top_k, group
        buf = rows.new_zeros((sum(counts) * top_k, rows.shape[1]))
        buf.index_copy_(0, where, rows)
        dist.all_reduce(buf, group=group)
        start, rank = sum(counts[:group.rank()]), group.rank()
        return buf.view(-1, top_k, rows.shape[1])[start:start + counts[rank]].clone()

    @staticmethod
    def backward(ctx, grad):
        (where,) = ctx.saved_tensors
        counts, k, rank = ctx.counts, ctx.top_k, ctx.group.rank()
        buf = grad.new_zeros((sum(counts), k, grad.shape[2]))
        start = sum(counts[:rank])
        buf[start:start + counts[rank]] = grad
        dist.all_reduce(buf, group=ctx.group)
        return buf.view(-1, grad.shape[2]).index_select(0, where), None, None, None, None


class RlkMoELayer(_RlkLayer, _M.MoELayer):
    """``MoELayer`` with rlk's route -> experts -> combine (module docstring). Its router and experts slots must hold
    :class:`RlkTopKRouter` and :class:`RlkGroupedExperts` (the spec puts them there)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        problems = moe_problems(self.config)
        if envs.current("RL_KERNEL_TP_EMULATE") is not None:
            problems.append("emulated TP (RL_KERNEL_TP_EMULATE) does not cover MoE layers")
        if not isinstance(self.router, RlkTopKRouter) or not isinstance(self.experts, RlkGroupedExperts):
            problems.append(f"the router / experts are {type(self.router).__name__} / {type(self.experts).__name__}, "
                            "not rlk's")
        self._rlk_setup("ffn", problems)
        self._ep = self.ep_group.size() if self.ep_group is not None else 1

    def forward(self, hidden_states: Tensor, intermediate_tensors=None, padding_mask: Tensor | None = None):
        if not self.rlk_active or intermediate_tensors is not None:
            raise RlkPolicyError("rlk-megatron-provider, module 'ffn': RlkMoELayer runs the whole layer "
                                 "(no partial CUDA-graph capture)")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        mask = padding_mask.transpose(0, 1).bool() if padding_mask is not None else None
        with _state.get().routes.scope("ffn"):  # moe_combine (and the dispatch backward's) report here
            weights, ids = self.router(hidden_states, mask)
            if self._ep == 1:
                r = moe_layer.route(ids, weights, self.config.num_moe_experts)
                o = self.experts(moe_layer.dispatch(x, r), r.offsets)
                y = moe_combine(moe_layer.undispatch(o, r), r.weights)
            else:
                y = self._expert_parallel(x, weights, ids)
        self.last_ids = ids.detach()  # the routing diagnostic's (rlk_repro.engine.routing)
        return y.view(shape), None

    def _expert_parallel(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """EP > 1: the group's tokens and expert ids gathered, this rank's pairs (those of its local experts) sorted
        by (expert, token, slot) — EP 1's order restricted to them — through the local experts, their rows back to
        their tokens' ranks and combined in slot order (module docstring)."""
        group, k = self.ep_group, ids.shape[1]
        counts = [int(c) for c in torch.cat(_all_gather(torch.tensor([ids.shape[0]], device=ids.device), group))]
        ids_all = _gather_rows(ids, counts, group)
        first, n = self.local_expert_indices[0], self.num_local_experts
        flat = ids_all.reshape(-1)
        pairs = ((flat >= first) & (flat < first + n)).nonzero().flatten()  # this rank's pairs, ascending
        r = moe_layer.route(flat.index_select(0, pairs)[:, None] - first, weights.new_ones((pairs.numel(), 1)), n)
        where = pairs.index_select(0, r.order)  # the pair of each sorted row
        rows = _DispatchEP.apply(x, torch.div(where, k, rounding_mode="floor"), where, counts, k, group)
        o = self.experts(rows, r.offsets)
        return moe_combine(_CombineEP.apply(o, where, counts, k, group), weights)


def moe_spec(base) -> _compat.ModuleSpec:
    """The rlk ``MoELayer`` spec in place of ``base`` (a stock ``MoELayer`` ``ModuleSpec``; its params kept): the
    layer, router and experts slots rlk's, no shared experts (refused by :func:`moe_problems`)."""
    if isinstance(base, functools.partial):  # megatron-core 0.19: functools.partial(MoELayer, submodules=...)
        params = {k: v for k, v in base.keywords.items() if k != "submodules"}
    else:
        params = dict(getattr(base, "params", {}) or {})
    return _compat.ModuleSpec(module=RlkMoELayer, params=params,
                              submodules=_M.MoESubmodules(experts=_compat.ModuleSpec(module=RlkGroupedExperts),
                                                          router=RlkTopKRouter))


def stock_router_without_te() -> bool:
    """Target: ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` (a module attribute), for the stock
    ``TopKRouter`` of a P ffn.

    Why: megatron-core 0.16.1 imports ``te_general_gemm`` from TransformerEngine inside a ``try`` and, without TE,
    leaves the name undefined; ``RouterGatingLinearFunction`` then tests ``te_general_gemm is not None`` and raises
    ``NameError`` instead of taking its own ``torch.mm`` branch. The stock router cannot run without TE at all.
    How: where TE is absent (``moe_utils.HAVE_TE`` false) and the name is undefined, it is set to ``None``: the branch
    Megatron wrote for that case (``torch.mm`` in the router dtype) runs. With TE, or a megatron-core that defines the
    name, nothing changes. Returns whether it set the name. rlk's router (an R ffn) never calls this GEMM.
    Upstream status: a megatron-core bug (0.16.1); not reported from here.
    Remove when: the supported megatron-core versions define the name without TE.
    """
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", True) or hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    if _state.current() is not None:
        _state.get().recorder.add_hook("stock_router_without_te", "megatron.core moe_utils.te_general_gemm",
                                       "module-attribute")
    return True


def _all_gather(x: Tensor, group) -> list[Tensor]:
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _gather_rows(x: Tensor, counts: list[int], group) -> Tensor:
    """The group's ``x`` (``counts[r]`` rows on rank ``r``) concatenated in rank order: exact data movement."""
    most = max(counts)
    pad = x.new_zeros((most, *x.shape[1:]))
    pad[:x.shape[0]] = x
    return torch.cat([p[:c] for p, c in zip(_all_gather(pad, group), counts, strict=True)])
