"""The ``logp`` module on the train side: rlk LM head, VIME's linear-logp provider, slime's binding.

Contract ``rlk.logp.v1`` (``docs/ops/linear_logprobs.md``): a token's log-prob depends only on its hidden
state, the LM-head weight, the temperature and its target id, not on the vocab sharding. Under tensor
parallelism each rank computes the partials of its vocab shard (``linear_logp_partials`` from hidden
states, or ``logp_partials`` from its logits), the partials are all-gathered in rank order (exact data
movement, :func:`rlk_collectives.all_gather`), the target's ``z`` is the MAX over ranks (exact; only
its owner's is finite), and ``merge_logp_partials`` merges them in the fixed tree: the result is bitwise
``linear_logprobs`` on the gathered vocabulary. Where gradients are needed under TP (the partials are
not differentiable in this rlk-core) the vocab shards are all-gathered and ``linear_logprobs`` /
``token_logprobs`` runs on the list of shards — the same bits, O(V x H) extra memory per rank.

Filtered sampling (contract ``rlk.logp.processed.v1``, ``docs/ops/kept_set.md``): with ``kept`` —
each row's kept set as one threshold ``(value, token_id)``, from :func:`kept_sets` (this side's own logits and
the rollout's top-k / top-p / min-p) or from the rollout — every path computes the processed log-prob over the
kept set, the same bits for any vocab sharding. A keep mask (slime's / VIME's top-p replay,
``log_prob_keep_mask``, ``[T, V/tp]`` bool) is applied to the logits as ``-inf`` (the mask form of the same
contract).

Entropy (contract ``rlk.entropy.v1``, ``docs/ops/entropy.md``): a request for entropy gets the entropy of the same
distribution its log-probs are of — over the kept set (the processed distribution) where a keep mask or kept sets
apply, over the whole vocabulary otherwise — from the rlk LM head's logits, the vocab shards all-gathered in rank
order (exact), ``entropy`` on the whole vocabulary (so any TP gives the same bits). Differentiable.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

import rlk_collectives
from rlk_core.errors import RlkPolicyError
from rlk_megatron_provider import _state
from rlk_megatron_provider.layers import RlkColumnParallelLinear

Tensor = torch.Tensor
CONTRACT_ID = "rlk.logp.v1"
BACKEND_ID = "rlk.megatron.linear_logp"


class RlkOutputLayer(RlkColumnParallelLinear):
    """``GPTModel.output_layer`` on the rlk GEMM (installed by
    :func:`rlk_megatron_provider.patches.use_rlk_output_layer`)."""

    def _rlk_init(self) -> None:
        self.rlk_module, self.rlk_active = "logp", True

    def _gemm(self, x: Tensor, w: Tensor) -> Tensor:
        return _logits_path_op("linear", x, w)


def _logits_path_op(op: str, *args):
    """``linear`` / ``token_logprobs`` for the logits path of an R ``logp`` (the LM head whose logits slime
    receives). rlk-core's route table lists only the fused ops for the train side's ``logp``
    (``MODULE_OPS[("logp", "train")]``), so ``SideRoutes.call`` refuses these two; the op still runs inside
    the ``logp`` scope and reports its backend and contract itself (workaround until the table lists them).
    """
    from rlk_core.routes import op_function

    st = _state.get()
    if not st.rlk("logp"):
        raise RlkPolicyError(f"rlk op {op!r} asked for logp, which is P on the train side")
    with st.routes.scope("logp"):
        return op_function(op)(*args)


def _train_only_op(op: str, *args, **kwargs):
    """An rlk op of the ``logp`` module that only the train side runs (``entropy``: a loss term, never compared with
    the rollout). It stays out of ``MODULE_OPS`` so that both sides' contract digests keep listing the same
    contracts (``rlk_core.digest``); it runs inside the ``logp`` scope and reports its backend and contract id in
    the readback itself."""
    from rlk_core.routes import op_function

    st = _state.get()
    if not st.rlk("logp"):
        raise RlkPolicyError(f"rlk op {op!r} asked for logp, which is P on the train side")
    with st.routes.scope("logp"):
        return op_function(op)(*args, **kwargs)


class _GatherVocab(torch.autograd.Function):
    """All-gather of vocab shards along ``dim`` (exact); backward: this rank's slice (Megatron's
    ``gather_from_tensor_model_parallel_region`` convention: the loss is replicated, not summed)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.rank, ctx.width, ctx.dim = group.rank(), x.shape[dim], dim
        return rlk_collectives.all_gather(x.detach(), group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.width).contiguous(), None, None


def _tp(group) -> tuple[int, int]:
    if group is None or group.size() == 1:
        return 1, 0
    return group.size(), group.rank()


def _merge(m: Tensor, s: Tensor, z: Tensor, vocab_size: int, group) -> Tensor:
    routes = _state.get().routes
    m_all = rlk_collectives.all_gather(m, group, dim=1)
    s_all = rlk_collectives.all_gather(s, group, dim=1)
    z_all = rlk_collectives.all_gather(z[None], group, dim=0).amax(0)  # MAX: exact, one finite entry
    return routes.call("logp", "merge_logp_partials", m_all, s_all, z_all, vocab_size)[0]


def vocab_parallel_logprobs(hidden: Tensor, weight_shard: Tensor, target: Tensor, temperature, group,
                            vocab_start: int | None = None, vocab_size: int | None = None, kept=None) -> Tensor:
    """``logp`` ``[T]`` fp32 of ``target`` from hidden states ``[T, H]`` and this rank's LM-head shard
    ``[V/tp, H]`` (contract ``rlk.logp.v1``; with ``kept``, the rows' kept sets, ``rlk.logp.processed.v1``);
    never materialises ``[T, V]`` logits when no gradient is needed. Differentiable w.r.t. ``hidden`` and
    ``weight_shard``."""
    st = _state.get()
    tp, rank = _tp(group)
    v_local = weight_shard.shape[0]
    vocab_start = rank * v_local if vocab_start is None else int(vocab_start)
    vocab_size = v_local * tp if vocab_size is None else int(vocab_size)
    with st.routes.scope("logp"):
        if tp == 1:
            return st.routes.call("logp", "linear_logprobs", hidden, weight_shard, target, temperature, kept=kept)[0]
        if torch.is_grad_enabled() and (hidden.requires_grad or weight_shard.requires_grad):
            full = _GatherVocab.apply(weight_shard, group, 0)
            shards = list(full.split(v_local, dim=0))
            return st.routes.call("logp", "linear_logprobs", hidden, shards, target, temperature, kept=kept)[0]
        m, s, z = st.routes.call("logp", "linear_logp_partials", hidden, weight_shard, target, temperature,
                                 vocab_start, vocab_size, kept=kept)
        return _merge(m, s, z, vocab_size, group)


def kept_sets(hidden: Tensor, weight_shard: Tensor, temperature, top_k, top_p, min_p, group,
              rows_per_chunk: int = 1024):
    """Each row's kept set (``rlk_core.ops.KeptSet``, contract ``rlk.logp.processed.v1``) from this side's own
    logits: the rlk LM-head GEMM on ``hidden`` ``[T, H]`` (no gradient), the vocab shards all-gathered in rank
    order (exact), ``kept_set`` on the whole vocabulary, ``rows_per_chunk`` rows at a time. ``top_k`` /
    ``top_p`` / ``min_p``: numbers (one setting for every row)."""
    from rlk_core.ops import KeptSet

    st = _state.get()
    tp, _ = _tp(group)
    parts = []
    with torch.no_grad(), st.routes.scope("logp"):
        for i in range(0, hidden.shape[0], rows_per_chunk):
            logits = st.routes.call("logp", "linear", hidden[i:i + rows_per_chunk].detach(), weight_shard.detach())
            if tp > 1:
                logits = rlk_collectives.all_gather(logits, group, dim=1)
            parts.append(st.routes.call("logp", "kept_set", logits, temperature, top_k, top_p, min_p))
    if not parts:
        empty = hidden.new_empty((0,), dtype=torch.float32)
        return KeptSet(empty, empty.long(), empty.long())
    return KeptSet(*(torch.cat([k[j] for k in parts]) for j in range(3)))


def vocab_parallel_logprobs_from_logits(logits: Tensor, target: Tensor, temperature, group) -> Tensor:
    """The same contract from this rank's logits shard ``[T, V/tp]`` (the rlk GEMM's, e.g. those of an
    :class:`RlkOutputLayer`): ``logp_partials`` + gather + merge, or ``token_logprobs`` on the gathered
    shards where a gradient is needed."""
    st = _state.get()
    tp, rank = _tp(group)
    v_local = logits.shape[-1]
    with st.routes.scope("logp"):
        if tp == 1:
            return _logits_path_op("token_logprobs", logits, target, temperature)[0]
        if torch.is_grad_enabled() and logits.requires_grad:
            full = _GatherVocab.apply(logits, group, logits.dim() - 1)
            shards = list(full.split(v_local, dim=-1))
            return _logits_path_op("token_logprobs", shards, target, temperature)[0]
        m, s, z = st.routes.call("logp", "logp_partials", logits, target, temperature, rank * v_local,
                                 v_local * tp)
        return _merge(m, s, z, v_local * tp, group)


def vocab_parallel_entropy(logits: Tensor, temperature, group, kept=None) -> Tensor:
    """``entropy`` ``[T]`` fp32 (contract ``rlk.entropy.v1``) of ``softmax(logits / T)`` over the kept set (``kept``
    a threshold pair, or ``-inf`` logits: the mask form) from this rank's logits shard ``[T, V/tp]``: the shards
    all-gathered in rank order (exact data movement; backward: this rank's slice) and the op run on the list of
    shards, so the bits do not depend on the TP size. Differentiable w.r.t. ``logits``."""
    tp, _ = _tp(group)
    v_local = logits.shape[-1]
    if tp > 1:
        full = _GatherVocab.apply(logits, group, logits.dim() - 1) if (
            torch.is_grad_enabled() and logits.requires_grad) else rlk_collectives.all_gather(logits, group, dim=1)
        shards = list(full.split(v_local, dim=-1))
    else:
        shards = [logits]
    return _train_only_op("entropy", shards, temperature, kept=kept)[0]


def _filters() -> dict[str, float] | None:
    """The rollout's top-k / top-p / min-p (``RL_KERNEL_LOGP_SAMPLING``), or None where it filters nothing."""
    from rlk_core import envs

    f = envs.get("RL_KERNEL_LOGP_SAMPLING")
    if f is None or (f["top_k"] == 0 and f["top_p"] >= 1.0 and f["min_p"] == 0.0):
        return None
    return f


# -- VIME: --linear-logp-provider rlk_megatron_provider.linear_logp ----------------------------------
@dataclass
class LinearLogpResult:
    """The provider result of VIME's ABI (field names as documented; VIME's own class is used when it
    can be imported, see :func:`_vime_types`)."""

    logp: Tensor
    entropy: Tensor | None
    backend_id: str
    contract_id: str
    provenance: dict[str, Any] = field(default_factory=dict)


class LinearLogpProviderUnavailable(RuntimeError):
    """Raised where VIME's ``auto`` mode should fall back to its native path."""


_VIME_MODULES = ("vime.backends.megatron_utils.linear_logp", "vime.utils.linear_logp")


def _vime_types() -> tuple[type, type]:
    """VIME's ``(LinearLogpResult, LinearLogpProviderUnavailable)`` if importable, else ours (unverified
    location upstream; the field names are the documented ABI)."""
    for name in _VIME_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        res, unav = getattr(mod, "LinearLogpResult", None), getattr(mod, "LinearLogpProviderUnavailable", None)
        if res is not None and unav is not None:
            return res, unav
    return LinearLogpResult, LinearLogpProviderUnavailable


def _field(obj, *names, default=None):
    for n in names:
        if isinstance(obj, dict) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


def linear_logp(request) -> Any:
    """VIME's linear-logp provider (``--linear-logp-provider rlk_megatron_provider.linear_logp
    --linear-logp-provider-mode strict``).

    Reads ``request.targets`` ``[T]``, ``request.tp_group``, ``request.token_layout`` (``single`` /
    ``zigzag`` / ``allgather``: the result is per token, so any layout), ``request.temperature`` (default 1)
    and ``request.context.{hidden [T, H], projection [V/tp, H], vocab_partition (start, end)}``; computes
    from the hidden states and the vocab-parallel LM head (never from ``local_logits``) and returns
    ``LinearLogpResult(logp [T] fp32, entropy, backend_id, contract_id, provenance)``."""
    from rlk_megatron_provider import initialize_from_environment

    st = _state.current() or initialize_from_environment()
    result_cls, unavailable = _vime_types()
    if not st.rlk("logp"):
        raise unavailable(f"rlk logp is {st.plan.letter('logp', 'train')} on the train side (plan {st.plan.name})")
    ctx = _field(request, "context")
    hidden, proj = _field(ctx, "hidden"), _field(ctx, "projection")
    target = _field(request, "targets", "target")
    if hidden is None or proj is None or target is None:
        st.refuse("logp", "the request lacks context.hidden, context.projection or targets")
        raise unavailable("request without hidden states / projection")
    with_entropy = bool(_field(request, "with_entropy", default=False))
    group = _field(request, "tp_group")
    temperature = _field(request, "temperature", default=1.0)
    part = _field(ctx, "vocab_partition")
    start, size = (None, None)
    if part is not None:
        start = int(_field(part, "start", "vocab_start", default=part[0] if isinstance(part, tuple) else 0))
        size = _field(part, "vocab_size", "global_vocab_size", default=None)
    h = hidden.reshape(-1, hidden.shape[-1])
    keep_mask = _field(request, "log_prob_keep_mask")
    kept = _field(_field(request, "metadata", default={}) or {}, "rlk_kept")  # (value, token_id) from the rollout
    flat_target = target.reshape(-1)
    applied, source, entropy = None, "rollout", None
    if keep_mask is not None:  # VIME's top-p replay: the mask form, on this rank's logits
        logits = _logits_path_op("linear", h, proj)
        logits = logits.masked_fill(~keep_mask.reshape(logits.shape).to(torch.bool), float("-inf"))
        logp = vocab_parallel_logprobs_from_logits(logits, flat_target, temperature, group)
        if with_entropy:
            entropy = vocab_parallel_entropy(logits, temperature, group)
    else:
        filters = _filters()
        if kept is None and filters is not None:  # the rollout's filters: this side's own kept sets
            applied = kept_sets(h, proj, temperature, filters["top_k"], filters["top_p"], filters["min_p"], group)
            kept, source = (applied.value, applied.token_id), "trainer"
        logp = vocab_parallel_logprobs(h, proj, flat_target, temperature, group, start, size, kept=kept)
        if with_entropy:
            entropy = vocab_parallel_entropy(_logits_path_op("linear", h, proj), temperature, group, kept=kept)
    prov = {"token_layout": _field(request, "token_layout"), "tp": _tp(group)[0], "rank": _tp(group)[1],
            "plan": st.plan.name,
            "logprobs": "processed (keep mask)" if keep_mask is not None else
                        "processed (rlk kept sets)" if kept is not None else "unfiltered"}
    if kept is not None:  # the threshold applied, per token in the order of `targets` (contract rlk.logp.processed.v1)
        prov["rlk_kept"] = {"value": kept[0], "token_id": kept[1], "source": source,
                            "size": applied.size if applied is not None else None}
    if with_entropy:
        prov["entropy"] = {"contract_id": "rlk.entropy.v1",
                           "distribution": "unfiltered" if keep_mask is None and kept is None else "processed"}
        entropy = entropy.reshape(target.shape)
    return result_cls(logp=logp.reshape(target.shape), entropy=entropy, backend_id=BACKEND_ID,
                      contract_id=CONTRACT_ID, provenance=prov)


# -- slime: loss.calculate_log_probs_and_entropy ------------------------------------------------------
def slime_log_probs_and_entropy(logits: Tensor, tokens: Tensor, tp_group, with_entropy: bool = False,
                                chunk_size: int = -1, log_prob_keep_mask: Tensor | None = None,
                                with_entropy_grad: bool = True, **kwargs):
    """Drop-in for slime's ``calculate_log_probs_and_entropy`` (bound by
    :func:`rlk_megatron_provider.patches.bind_slime_logprobs`): ``(log_prob, entropy)`` with ``log_prob``
    shaped like ``tokens``, fp32, contract ``rlk.logp.v1`` on the (already temperature-divided) local
    logits. ``chunk_size`` changes nothing (results are per row)."""
    st = _state.get()
    if not st.rlk("logp"):
        raise RlkPolicyError("slime_log_probs_and_entropy is bound but logp is P on the train side")
    if kwargs:
        raise RlkPolicyError(f"rlk-megatron-provider, module 'logp': slime's arguments {sorted(kwargs)} are not "
                             f"covered")
    if logits.shape[0] == 0:
        empty = logits.new_zeros(tokens.shape, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    flat = logits.reshape(-1, logits.shape[-1])
    if log_prob_keep_mask is not None:  # top-p replay: the kept set's mask form (-inf outside it), same contract
        flat = flat.masked_fill(~log_prob_keep_mask.reshape(flat.shape).to(torch.bool), float("-inf"))
    elif _filters() is not None:  # the rollout's filters: kept sets of the (already tempered) logits, gathered
        f = _filters()
        tp, rank = _tp(tp_group)
        full = flat.detach() if tp == 1 else rlk_collectives.all_gather(flat.detach(), tp_group, dim=1)
        with st.routes.scope("logp"):
            ks = st.routes.call("logp", "kept_set", full, 1.0, f["top_k"], f["top_p"], f["min_p"])
        from rlk_core.ops.kept_set import kept_mask

        keep = kept_mask(flat.detach(), 1.0, ks, rank * flat.shape[-1])
        flat = flat.masked_fill(~keep, float("-inf"))
    logp = vocab_parallel_logprobs_from_logits(flat, tokens.reshape(-1), 1.0, tp_group)
    entropy = None
    if with_entropy:  # of the same distribution as logp (processed where a mask / filters apply), rlk.entropy.v1
        entropy = vocab_parallel_entropy(flat if with_entropy_grad else flat.detach(), 1.0, tp_group)
        entropy = entropy.reshape(tokens.shape)
    return logp.reshape(tokens.shape), entropy
