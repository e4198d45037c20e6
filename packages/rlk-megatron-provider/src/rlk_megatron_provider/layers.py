"""Megatron layers whose arithmetic is rlk's: parallel linears, RMSNorm, the SwiGLU MLP.

Each class subclasses the Megatron layer it stands in for (same constructor, parameters, sharding
attributes and state-dict keys) and replaces only ``forward``: the GEMM is ``rlk_core.ops.linear``, the
norm ``rms_norm``, the activation ``swiglu``, each called through the train-side routes of
:mod:`rlk_core.routes` under the module (``attention``, ``ffn`` or ``logp``) the layer belongs to, so
every call reports its backend and contract to the readback. The tensor-parallel communication around
them goes through :mod:`rlk_collectives` (contract ``rlk.collective.v1``) with Megatron's gradient
conventions:

============================  ==================================  =====================================
layer                         forward                             backward
============================  ==================================  =====================================
column-parallel input         identity                            rlk all-reduce of the input gradient
column-parallel gathered out  rlk all-gather (last dim, exact)    own slice of the gradient
row-parallel output           rlk all-reduce of the partial sums  identity
row-parallel, TP-invariant    rlk all_reduce_partials (fp32)      identity (into the fp32 partial)
column-parallel, TP-invariant identity                            dX by rlk.gemm.tp.v1 over N, merged
============================  ==================================  =====================================

Emulated TP (``RL_KERNEL_TP_EMULATE=t``, invariant mode at real TP 1): every TP-split op runs as the t ranks of TP
t would, their partials merged in process (:mod:`rlk_megatron_provider.tp_emulate`).

TP-invariant mode (``RL_KERNEL_TP_INVARIANT=G``, read when a layer is built): a row-parallel linear runs
``linear_tp_partials`` over its G / TP K-leaves and ``rlk_collectives.all_reduce_partials`` (contract
``rlk.gemm.tp.v1``, docs/ops/linear_tp.md), so its output has the same bits at every TP dividing G; a
column-parallel linear's input gradient is the same GEMM over N (:mod:`rlk_megatron_provider.tp_grads`), so the
gradients are too.

Nothing here computes: every floating-point operation is an rlk op or an rlk collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

import rlk_collectives
from rlk_core import envs
from rlk_core.errors import RlkPolicyError
from rlk_core.ops.linear_tp import group_leaves
from rlk_megatron_provider import _compat, _state, tp_emulate, tp_grads

Tensor = torch.Tensor


def _tp(group) -> int:
    return 1 if group is None else group.size()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, module, check=True):
        ctx.group, ctx.module, ctx.check = group, module, check
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with _state.get().routes.scope(ctx.module):
            return rlk_collectives.all_reduce(grad.detach(), ctx.group, check=ctx.check), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, module, check=True):
        with _state.get().routes.scope(module):
            return rlk_collectives.all_reduce(x.detach(), group, check=check)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, module, check=True):
        ctx.rank, ctx.width = group.rank(), x.shape[-1]
        with _state.get().routes.scope(module):
            return rlk_collectives.all_gather(x.detach(), group, dim=-1, check=check)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None, None, None


class _GatherSeq(torch.autograd.Function):
    """Sequence parallelism's all-gather over the tokens (dim 0, exact); backward: the rlk reduce-scatter of the
    gradient (Megatron's ``gather_from_sequence_parallel_region``, the output of a vocab-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group, module, check=True):
        ctx.group, ctx.module, ctx.check = group, module, check
        with _state.get().routes.scope(module):
            return rlk_collectives.all_gather(x.detach(), group, dim=0, check=check)

    @staticmethod
    def backward(ctx, grad):
        with _state.get().routes.scope(ctx.module):
            return rlk_collectives.reduce_scatter(grad.detach(), ctx.group, 0, check=ctx.check), None, None, None


class _ReduceScatterPartialsFromTP(torch.autograd.Function):
    """The row-parallel merge of ``rlk.gemm.tp.v1`` under sequence parallelism: the ranks' fp32 partials
    reduce-scattered over the tokens (dim 0) by the same rank tree, rounded once; backward the all-gather of the
    rows' gradients (exact) into the fp32 partial."""

    @staticmethod
    def forward(ctx, s, group, module, check, leaves, dtype):
        ctx.group, ctx.module, ctx.check = group, module, check
        with _state.get().routes.scope(module):
            return rlk_collectives.reduce_scatter_partials(s.detach(), group, 0, leaves_total=leaves, dtype=dtype,
                                                           check=check)

    @staticmethod
    def backward(ctx, grad):
        with _state.get().routes.scope(ctx.module):
            full = rlk_collectives.all_gather(grad.detach().contiguous(), ctx.group, dim=0, check=ctx.check)
        return full.float(), None, None, None, None, None


class _ReducePartialsFromTP(torch.autograd.Function):
    """The row-parallel merge of ``rlk.gemm.tp.v1``: the ranks' fp32 partials by the rank tree, rounded once to
    ``dtype``; backward the identity (Megatron's convention for the row-parallel reduce), into the fp32 partial."""

    @staticmethod
    def forward(ctx, s, group, module, check, leaves, dtype):
        with _state.get().routes.scope(module):
            return rlk_collectives.all_reduce_partials(s.detach(), group, leaves_total=leaves, dtype=dtype,
                                                       check=check)

    @staticmethod
    def backward(ctx, grad):
        return grad.float(), None, None, None, None, None


def copy_to_tp(x: Tensor, group, module: str) -> Tensor:
    return _CopyToTP.apply(x, group, module) if _tp(group) > 1 else x


def reduce_from_tp(x: Tensor, group, module: str) -> Tensor:
    return _ReduceFromTP.apply(x, group, module) if _tp(group) > 1 else x


def gather_last_dim(x: Tensor, group, module: str) -> Tensor:
    return _GatherLastDim.apply(x, group, module) if _tp(group) > 1 else x


def linear_problems(layer, config) -> list[str]:
    """Why a Megatron parallel linear cannot run the rlk route (empty: it can)."""
    out = []
    if getattr(layer, "bias", None) is not None:
        out.append("the layer has a bias (add_bias_linear): rlk linears cover bias-free (Qwen3-style) layers")
    if getattr(config, "sequence_parallel", False) and not envs.current("RL_KERNEL_TP_INVARIANT"):
        out.append("sequence_parallel=True is covered in TP-invariant mode only (set RL_KERNEL_TP_INVARIANT)")
    if getattr(layer, "gradient_accumulation_fusion", False):
        out.append("gradient_accumulation_fusion (a fused CUDA wgrad kernel) is requested")
    if getattr(layer, "is_expert", False) or getattr(layer, "explicit_expert_comm", False):
        out.append("expert (MoE) linears are not covered")
    if getattr(config, "tp_comm_overlap", False):
        out.append("tp_comm_overlap (TE userbuffers) is requested")
    if getattr(config, "fp8", None):
        out.append(f"fp8={config.fp8!r} is requested (a TE feature)")
    return out


class _RlkLayer:
    """Shared bookkeeping: which module the layer belongs to and whether it runs rlk.

    ``rlk_check_collectives``: whether this layer's rlk TP collectives exchange metadata across the ranks
    first (``check=True``: a small all-gather and a host read, two host syncs, per call). On by default;
    :func:`rlk_megatron_provider.spec.prepare_model` leaves it on only in the first layer of each kind (see
    :func:`rlk_megatron_provider.spec.check_collectives_once`)."""

    rlk_check_collectives = True
    rlk_tp_leaves = 0  # G of RL_KERNEL_TP_INVARIANT when the layer was built (0: off)
    rlk_tp_emulate = None  # the tp_emulate.Emulation of RL_KERNEL_TP_EMULATE when the layer was built (None: off)

    def _rlk_setup(self, module: str, problems: list[str]) -> None:
        st = _state.get()
        self.rlk_module = module
        self.rlk_active = st.rlk(module)
        if self.rlk_active and problems:
            self.rlk_active = st.refuse(module, f"{type(self).__name__}: " + "; ".join(problems))

    def _tp_group(self) -> tuple:
        """``(group, size)`` of the layer's TP group; the size is read once per group object (a
        ProcessGroup's ``size()`` is a C++ call per use otherwise, several per layer and step)."""
        group = _compat.tp_group_of(self)
        cached = self.__dict__.get("_rlk_tp")
        if cached is None or cached[0] is not group:
            cached = self.__dict__["_rlk_tp"] = (group, _tp(group))
        return cached

    def _production(self, op: str) -> None:
        _state.get().routes.production(self.rlk_module, op, f"{_state.PRODUCTION}.{type(self).__mro__[1].__name__}")


class RlkColumnParallelLinear(_RlkLayer, _compat.ColumnParallelLinear):
    """``ColumnParallelLinear`` on ``rlk_core.ops.linear``; built with ``rlk_module=`` (spec params)."""

    def __init__(self, *args, rlk_module: str, **kwargs):
        super().__init__(*args, **kwargs)
        problems = linear_problems(self, self.config)
        self.rlk_module = rlk_module
        self.rlk_tp_leaves = envs.current("RL_KERNEL_TP_INVARIANT")
        if rlk_module in ("attention", "ffn"):  # QKV, fc1 (the LM head's arithmetic does not depend on TP)
            self.rlk_tp_emulate = tp_emulate.emulation(self.config, lambda: _tp(_compat.tp_group_of(self)))
        if self.rlk_tp_leaves:
            problems += tp_grads.column_problems(self._rlk_components(), self.rlk_tp_leaves,
                                                 _tp(_compat.tp_group_of(self)))
        self._rlk_setup(rlk_module, problems)

    def _rlk_components(self) -> list[int]:
        """The local sizes of the weight's components, back to back in its rows (a gated fc1: ``[gate_r; up_r]``)."""
        n = self.output_size_per_partition
        if self.rlk_module == "ffn" and getattr(self.config, "gated_linear_unit", False):
            return [n // 2, n // 2]
        return [n]

    def _rlk_leaf_rows(self, leaves: int, device) -> Tensor:
        """The local rows in leaf-major order (TP-invariant input gradient), built once per device."""
        cached = self.__dict__.get("_rlk_rows")
        if cached is None or cached.device != device:
            cached = self.__dict__["_rlk_rows"] = tp_grads.leaf_rows(self._rlk_components(), leaves, device)
        return cached

    def _rlk_rank_rows(self, tp: int, device) -> tuple[list[Tensor], Tensor]:
        """Emulated TP: each rank's rows of the TP 1 weight and their inverse (:func:`tp_emulate.rank_rows`), once."""
        cached = self.__dict__.get("_rlk_ranks")
        if cached is None or cached[1].device != device:
            cached = self.__dict__["_rlk_ranks"] = tp_emulate.rank_rows(self._rlk_components(), tp, device)
        return cached

    def _rlk_input(self, input_: Tensor, group, tp: int) -> Tensor:
        """Megatron's copy-to-TP region (identity forward, rlk all-reduce of the input gradient) — in TP-invariant
        mode part of the GEMM's own backward (:class:`~rlk_megatron_provider.tp_grads.ColumnTPInvariant`)."""
        if tp > 1 and not self.rlk_tp_leaves:
            if getattr(self, "sequence_parallel", False):  # the LM head's logits path (others are refused)
                return _GatherSeq.apply(input_, group, self.rlk_module, self.rlk_check_collectives)
            return _CopyToTP.apply(input_, group, self.rlk_module, self.rlk_check_collectives)
        return input_

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        if not self.rlk_active:
            self._production("linear")
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        w = self.weight if weight is None else weight
        group, tp = self._tp_group()
        x = self._rlk_input(input_, group, tp)
        y = self._gemm(x, w)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and tp > 1:
            y = _GatherLastDim.apply(y, group, self.rlk_module, self.rlk_check_collectives)
        return y, None


    def _gemm(self, x: Tensor, w: Tensor) -> Tensor:
        if self.rlk_tp_emulate is not None:
            return tp_emulate.ColumnRanks.apply(x, w, self)
        if self.rlk_tp_leaves:
            return tp_grads.ColumnTPInvariant.apply(x, w, self)
        return _state.get().routes.call(self.rlk_module, "linear", x, w)


# -- weight-derived operands cached across calls ------------------------------------------------------
_GENERATION = [0]
_STEP_HOOK: list = []


def invalidate_weight_caches() -> None:
    """Mark every cached weight-derived operand stale (the next forward rebuilds it from the parameter).

    Called automatically after every ``torch.optim.Optimizer.step`` (a global post-step hook, installed
    with the provider's state; Megatron's optimizers wrap torch optimizers, and Megatron writes the new
    bf16 weights through ``param.data``, which does not bump the version counter). Call it yourself after
    writing parameters by other means outside autograd's view (``param.data.copy_``) without a step."""
    _GENERATION[0] += 1


def install_step_hook() -> None:
    """Register :func:`invalidate_weight_caches` as a global optimizer post-step hook (once per process)."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(
            lambda *_args, **_kwargs: invalidate_weight_caches()))


class _CachedRows(torch.autograd.Function):
    """``w.index_select(0, rows)`` served from ``layer``'s cache; backward: the exact inverse gather
    (``grad.index_select(0, inverse)``) into the parameter's gradient."""

    @staticmethod
    def forward(ctx, w, layer):
        ctx.layer = layer
        return layer._permuted_weight(w).view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.layer._qkv_cols), None


class _GroupedColumns(torch.autograd.Function):
    """``[..., q | k | v]`` columns to Megatron's grouped order ``[..., G, (Hq/Hkv q heads, k, v), d]``
    and back in the backward: exact data movement (one copy kernel per part), no index kernels."""

    @staticmethod
    def forward(ctx, y, groups, heads_per_group, d):
        ctx.shape = (groups, heads_per_group, d)
        lead = y.shape[:-1]
        q, k, v = y.reshape(-1, y.shape[-1]).split([groups * heads_per_group * d, groups * d, groups * d], -1)
        t = q.shape[0]
        out = torch.cat([q.view(t, groups, heads_per_group * d), k.view(t, groups, d), v.view(t, groups, d)], -1)
        return out.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        groups, hpg, d = ctx.shape
        lead, n = grad.shape[:-1], grad.shape[-1]
        g = grad.reshape(-1, groups, (hpg + 2) * d)
        out = grad.new_empty((g.shape[0], n))
        nq = groups * hpg * d
        out[:, :nq].view(-1, groups, hpg * d).copy_(g[..., :hpg * d])
        out[:, nq:nq + groups * d].view(-1, groups, d).copy_(g[..., hpg * d:(hpg + 1) * d])
        out[:, nq + groups * d:].view(-1, groups, d).copy_(g[..., (hpg + 1) * d:])
        return out.view(*lead, n), None, None, None


class RlkQKVLinear(RlkColumnParallelLinear):
    """The attention's ``linear_qkv``: Megatron's parameter (rows grouped per KV head: ``Hq/Hkv`` query
    heads, then the key head, then the value head, per group), computed with the rows in the local
    ``[q; k; v]`` order (rlk-repro's trainer, vLLM's ``qkv_proj``) and the output columns put back.

    Both moves are exact gathers. The forward is the GEMM of the ``[q; k; v]`` weight (the same bits as the
    local trainer's), and its backward reduces ``dX = dY W`` over the rows in the ``[q; k; v]`` order, so the
    gradients below the projection equal the local trainer's bit for bit (in Megatron's row order the
    reduction order differs, ~1e-6 in fp32). The ``[q; k; v]`` copy of the weight is kept (one extra copy
    of the local QKV weight per layer) and rebuilt only when the parameter changed: a new storage, a bumped
    version counter, or an optimizer step (:func:`invalidate_weight_caches`). The weight gradient goes back
    to Megatron's parameter through the inverse gather. Checkpoints and state dicts keep Megatron's layout.
    Inside :class:`~rlk_megatron_provider.attention.RlkSelfAttention` the output columns are not moved back:
    it asks for the ``[q | k | v]`` columns (``rlk_qkv_order=True``) and splits them into views."""

    def __init__(self, *args, rlk_module: str, **kwargs):
        super().__init__(*args, rlk_module=rlk_module, **kwargs)
        install_step_hook()  # an optimizer step invalidates the cached [q; k; v] copy
        c = self.config
        heads_per_group, d = c.num_attention_heads // c.num_query_groups, c.kv_channels
        rows = self.output_size_per_partition
        if rows % ((heads_per_group + 2) * d):
            raise RlkPolicyError(f"rlk-megatron-provider, module {rlk_module!r}: linear_qkv has {rows} rows per "
                                 f"rank, not a multiple of ({heads_per_group} + 2) x {d}")
        self._qkv_shape = (rows // ((heads_per_group + 2) * d), heads_per_group, d)
        grouped = torch.arange(rows).reshape(-1, heads_per_group + 2, d)
        order = torch.cat([grouped[:, :heads_per_group].reshape(-1), grouped[:, heads_per_group].reshape(-1),
                           grouped[:, heads_per_group + 1].reshape(-1)])
        self._qkv_rows = order  # [q; k; v] row i is Megatron's row order[i]
        self._qkv_cols = torch.argsort(order)  # Megatron's column j is [q; k; v] column inverse[j]
        self._qkv_cache: tuple[tuple, Tensor] | None = None

    def _permuted_weight(self, w: Tensor) -> Tensor:
        """The cached ``[q; k; v]`` copy of ``w``, rebuilt where ``w`` is another tensor, storage, dtype or
        device, its version counter moved or an optimizer step ran since. Per call: the key and one
        comparison (the index tensors' device is looked at only when rebuilding)."""
        key = (id(w), w.data_ptr(), w._version, w.dtype, w.device, _GENERATION[0])
        d = self.__dict__  # plain attributes: nn.Module.__setattr__ would check parameters and buffers first
        cached = d["_qkv_cache"]
        if cached is None or cached[0] != key:
            if self._qkv_rows.device != w.device:
                d["_qkv_rows"], d["_qkv_cols"] = self._qkv_rows.to(w.device), self._qkv_cols.to(w.device)
            # a fresh tensor (a graph that saved the old copy keeps it); detached, so no graph is recorded
            cached = d["_qkv_cache"] = (key, w.detach().index_select(0, self._qkv_rows))
        return cached[1]

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None,
                *, rlk_qkv_order: bool = False):
        """Megatron's contract (output columns grouped per KV head), or with ``rlk_qkv_order=True`` the
        GEMM's own ``[q | k | v]`` columns (what :class:`~rlk_megatron_provider.attention.RlkSelfAttention`
        splits into views: no regrouping copy forward, none backward)."""
        if not rlk_qkv_order:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if not self.rlk_active or self.gather_output or runtime_gather_output:
            raise RlkPolicyError("rlk-megatron-provider: linear_qkv(rlk_qkv_order=True) needs the active rlk "
                                 "route and no gathered output")
        w = self.weight if weight is None else weight
        group, tp = self._tp_group()
        x = self._rlk_input(input_, group, tp)
        return RlkColumnParallelLinear._gemm(self, x, _CachedRows.apply(w, self)), None

    def _rlk_components(self) -> list[int]:
        """``[q_r, k_r, v_r]``: the rows of the ``[q; k; v]`` copy the GEMM runs on."""
        c, tp = self.config, _tp(_compat.tp_group_of(self))
        kv = c.num_query_groups // tp * c.kv_channels
        return [c.num_attention_heads // tp * c.kv_channels, kv, kv]

    def _gemm(self, x: Tensor, w: Tensor) -> Tensor:
        y = super()._gemm(x, _CachedRows.apply(w, self))
        return _GroupedColumns.apply(y, *self._qkv_shape)


class RlkRowParallelLinear(_RlkLayer, _compat.RowParallelLinear):
    """``RowParallelLinear`` on ``rlk_core.ops.linear`` + the rlk all-reduce of the partial sums.

    Under TP the result is ``tree_sum_fp32`` over ranks of each rank's rlk GEMM over its K shard (one
    rounding): bitwise what a TP-k rollout computes, not what TP 1 computes (the K reduction differs).
    In TP-invariant mode (``RL_KERNEL_TP_INVARIANT=G`` when the layer is built): ``linear_tp_partials`` over the
    rank's G / TP leaves, merged by ``all_reduce_partials`` — the same bits at every TP dividing G."""

    def __init__(self, *args, rlk_module: str, **kwargs):
        super().__init__(*args, **kwargs)
        problems = linear_problems(self, self.config)
        if not self.input_is_parallel:
            problems.append("input_is_parallel=False (a scatter of the input) is not covered")
        self.rlk_tp_leaves = envs.current("RL_KERNEL_TP_INVARIANT")
        self.rlk_tp_emulate = tp_emulate.emulation(self.config, lambda: _tp(_compat.tp_group_of(self)))
        if self.rlk_tp_leaves:
            tp = _tp(_compat.tp_group_of(self))
            if tp & (tp - 1) or self.rlk_tp_leaves % tp:
                problems.append(f"TP {tp} is not a power of two dividing RL_KERNEL_TP_INVARIANT={self.rlk_tp_leaves}")
        self._rlk_setup(rlk_module, problems)

    def forward(self, input_: Tensor):
        if not self.rlk_active:
            self._production("linear")
            return super().forward(input_)
        routes = _state.get().routes
        group, tp = self._tp_group()
        if self.rlk_tp_emulate is not None:
            return tp_emulate.row_parallel(self, input_), None
        if self.rlk_tp_leaves:
            if tp == 1:  # the whole tree and the one rounding in one op
                return routes.call(self.rlk_module, "linear_tp", input_, self.weight, None, self.rlk_tp_leaves), None
            s = routes.call(self.rlk_module, "linear_tp_partials", input_, self.weight, self.rlk_tp_leaves // tp)
            merge = _ReduceScatterPartialsFromTP if self.sequence_parallel else _ReducePartialsFromTP
            return merge.apply(s, group, self.rlk_module, self.rlk_check_collectives, self.rlk_tp_leaves,
                               input_.dtype), None
        y = routes.call(self.rlk_module, "linear", input_, self.weight)
        return (_ReduceFromTP.apply(y, group, self.rlk_module, self.rlk_check_collectives) if tp > 1 else y), None


class RlkRMSNorm(_RlkLayer, torch.nn.Module):
    """RMSNorm on ``rlk_core.ops.rms_norm``; constructed like Megatron's norms
    (``config, hidden_size, eps``) plus ``rlk_module=``. Parameter ``weight`` (fp32 master, as
    ``WrappedTorchNorm`` keeps it), so state-dict keys match the local spec's."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, rlk_module: str, **kwargs):
        super().__init__()
        self.config, self.eps = config, float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.rlk_module, self.rlk_active = rlk_module, _state.get().rlk(rlk_module)
        self.rlk_tp_leaves = envs.current("RL_KERNEL_TP_INVARIANT")
        self.rlk_tp_emulate = tp_emulate.emulation(config, lambda: _tp(_compat.tp_group_of(self)))
        if not self.rlk_active:  # the spec keeps the stock norm for such modules; reaching here is a bug
            raise RlkPolicyError(f"RlkRMSNorm built for module {rlk_module!r}, which does not run rlk")

    rlk_head_tree = None  # (TP group, heads, G): a q/k norm in TP-invariant mode (set by RlkSelfAttention)

    def forward(self, x: Tensor) -> Tensor:
        st = _state.get()
        if self.rlk_head_tree is not None:  # the weight gradient over head leaves, merged over the TP ranks
            group, heads, leaves = self.rlk_head_tree
            em = self.rlk_tp_emulate  # emulated TP: the heads' leaves are those of its ranks
            return tp_grads.leaf_norm(x, self.weight, self.eps, self.rlk_module, dim=-2,
                                      leaves_total=group_leaves(heads, leaves), group=group,
                                      check=self.rlk_check_collectives, ranks=em.tp if em else 1)
        if self.rlk_tp_leaves and torch.is_grad_enabled() and self.weight.requires_grad:
            # the weight gradient over gcd(T, G) token leaves (sequence parallelism: the rank's, merged over the ranks)
            group = _compat.tp_group_of(self) if self.weight.sequence_parallel else None
            tokens = x.shape[0] * (1 if group is None else group.size())
            em = self.rlk_tp_emulate  # emulated sequence parallelism: the tokens' leaves are those of its ranks
            ranks = em.tp if em is not None and em.sp else 1
            if tokens % ranks:
                raise RlkPolicyError(f"rlk-megatron-provider, emulated TP {ranks} with sequence parallelism: "
                                     f"{tokens} tokens are not divisible by {ranks}")
            return tp_grads.leaf_norm(x, self.weight, self.eps, self.rlk_module, dim=0,
                                      leaves_total=group_leaves(tokens, self.rlk_tp_leaves), group=group,
                                      check=self.rlk_check_collectives, ranks=ranks)
        return st.routes.call(self.rlk_module, "rms_norm", x, self.weight, self.eps)


class RlkMLP(_RlkLayer, _compat.MLP):
    """Megatron's dense MLP with ``rlk_core.ops.swiglu`` between its (rlk) fc1 and fc2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        problems = []
        if not (self.config.gated_linear_unit and self.config.activation_func is F.silu):
            problems.append("the activation is not SwiGLU (gated_linear_unit with F.silu)")
        if getattr(self.config, "use_te_activation_func", False):
            problems.append("use_te_activation_func (a TE activation) is requested")
        self._rlk_setup("ffn", problems)

    def forward(self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs):
        if not self.rlk_active or per_token_scale is not None:
            if per_token_scale is not None and self.rlk_active:
                raise RlkPolicyError("rlk-megatron-provider, module 'ffn': per_token_scale (MoE) is not covered")
            self._production("swiglu")
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        y, _ = self.linear_fc1(hidden_states)
        a = _state.get().routes.call("ffn", "swiglu", y)
        return self.linear_fc2(a)
