"""Core attention for Megatron's layer spec on ``rlk_core.ops.attention_varlen``, RoPE on ``rope``.

:class:`RlkSelfAttention` is Megatron's ``SelfAttention`` with one change: it does not apply Megatron's
rotary embedding; :class:`RlkCoreAttention` (the spec's ``core_attention``) applies ``rlk_core.ops.rope``
at each token's absolute position and then runs ``attention_varlen``. Layouts:

- ``sbhd`` (``packed_seq_params=None``): ``[sq, b, heads, hd]``, causal, every row a sequence from 0;
- packed THD (``packed_seq_params.qkv_format == 'thd'``, ``[t, heads, hd]``, global ``cu_seqlens``), as
  slime feeds it — what Megatron's local ``DotProductAttention`` refuses;
- context parallel (CP group size > 1) in Megatron's zigzag layout: local Q stays, K/V are gathered
  through :func:`rlk_collectives.cp_all_gather_kv` (their gradients come back through the rlk
  reduce-scatter) and each query carries its global position (``q_positions``). The attention contract
  makes CP k bitwise equal to CP 1.

Host syncs: none per layer. A packed batch's ``cu_seqlens_q`` are read to the host once per batch (one
device-to-host copy, checked there: offsets, ``cu_seqlens_kv`` / ``*_padded`` when they are other
tensors, the longest sequence against the model's maximum length); positions and the int32 offsets are
built on the device from the given tensors. RoPE's cos/sin table is reserved for the model's
``max_sequence_length`` (set by :func:`rlk_megatron_provider.prepare_model`) at the first forward on a
device, so ``rlk_core.ops.rope`` does not size it from each call's positions (a sync per call); a batch
longer than that maximum is refused, naming both lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlk_collectives
from rlk_core import envs
from rlk_core.errors import RlkPolicyError
from rlk_core.ops.rope import reserve_tables
from rlk_megatron_provider import _compat, _state, tp_emulate
from rlk_megatron_provider.layers import RlkQKVLinear, RlkRMSNorm

Tensor = torch.Tensor


def config_problems(config) -> list[str]:
    """Why the attention module of a model with this config cannot run rlk (empty: it can)."""
    out = []
    if getattr(config, "attention_dropout", 0.0):
        out.append(f"attention_dropout={config.attention_dropout} (rlk attention has no dropout)")
    if getattr(config, "rotary_interleaved", False):
        out.append("rotary_interleaved=True (rlk RoPE is the rotate-half layout)")
    if getattr(config, "multi_latent_attention", False):
        out.append("multi-latent attention is not covered")
    if getattr(config, "attention_output_gate", False):
        out.append("attention_output_gate is not covered")
    if getattr(config, "no_rope_freq", None):
        out.append("no_rope_freq (layers without RoPE) is not covered")
    if getattr(config, "window_size", None) is not None:
        out.append("sliding-window attention is not covered")
    if getattr(config, "softmax_type", "vanilla") not in ("vanilla", None):
        out.append(f"softmax_type={config.softmax_type!r} is not covered")
    if getattr(config, "flash_decode", False):
        out.append("flash_decode (an inference path) is not covered")
    return out


class RlkSelfAttention(_compat.SelfAttention):
    """``SelfAttention`` that leaves RoPE to :class:`RlkCoreAttention` (rlk's RoPE, not Megatron's). In
    TP-invariant mode its rlk q/k norms merge their weight gradient over head leaves and ranks
    (:class:`~rlk_megatron_provider.tp_grads.HeadLeavesNorm`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        leaves = envs.current("RL_KERNEL_TP_INVARIANT")
        if leaves:
            group = _compat.tp_group_of(self.linear_qkv)
            for norm, heads in ((self.q_layernorm, self.config.num_attention_heads),
                                (self.k_layernorm, self.config.num_query_groups)):
                if isinstance(norm, RlkRMSNorm):
                    norm.rlk_head_tree = (group, heads, leaves)

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        if args:
            raise TypeError("RlkSelfAttention takes hidden_states and attention_mask positionally, the rest "
                            "by keyword")
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            _unsupported("Megatron inference contexts (KV cache) are not covered")
        rotary = kwargs.pop("rotary_pos_emb", None)
        core = self.core_attention
        if core.apply_rope is not (rotary is not None):  # nn.Module.__setattr__ only when it changes
            core.apply_rope = rotary is not None
        return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False,
                                    split_qkv: bool = True):
        """Megatron's ``SelfAttention.get_query_key_value_tensors`` for an active rlk ``linear_qkv``
        without its two copies: the GEMM's ``[q | k | v]`` columns are split into views (Megatron regroups
        them per KV head, splits, and copies the query heads into a contiguous tensor; the backward moves
        the gradient columns back). The same values in the same head order (``q`` group-major, then
        ``k``, then ``v``), so the same bits downstream. Other configurations (an output gate, the unsplit
        tensor, fewer KV heads than TP ranks, Megatron's test mode) take Megatron's own path."""
        qkv = self.linear_qkv
        if (output_gate or not split_qkv or type(qkv) is not RlkQKVLinear or not qkv.rlk_active
                or qkv.gather_output or self.config.num_query_groups < self.world_size or self.config.test_mode):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                       split_qkv=split_qkv)
        y, _ = qkv(hidden_states, rlk_qkv_order=True)  # [sq, b, (Hq + 2 G) d], [q | k | v]
        d, hq, g = (self.hidden_size_per_attention_head, self.num_attention_heads_per_partition,
                    self.num_query_groups_per_partition)
        lead = y.shape[:-1]
        query, key, value = torch.split(y, [hq * d, g * d, g * d], dim=-1)  # one cat in the backward
        query, key, value = query.view(*lead, hq, d), key.view(*lead, g, d), value.view(*lead, g, d)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


def _positions(cu: Tensor, total: int) -> Tensor:
    """int64 ``[total]``: each packed token's position inside its sequence, from the offsets on the device
    (token ``t`` of sequence ``b = #{ends <= t}`` is at ``t - cu[b]``; zero-length sequences included):
    five kernels, no host round trip."""
    cu64 = cu.long()
    t = torch.arange(total, device=cu.device)
    return t - cu64.index_select(0, torch.searchsorted(cu64[1:], t, right=True))


class RlkCoreAttention(_compat.MegatronModule):
    """The spec's ``core_attention``: constructed and called as Megatron's core attentions are
    (unknown keyword arguments accepted and ignored), plus ``rope_theta`` from the spec's params.
    ``rlk_check_collectives``: as for the rlk linears (the CP K/V all-gather's metadata exchange)."""

    rlk_check_collectives = True

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, *, rope_theta: float, **kwargs):
        super().__init__(config=config)
        self.layer_number, self.rope_theta = layer_number, float(rope_theta)
        self.pg_collection = pg_collection
        self.head_dim = config.kv_channels
        self.scale = float(softmax_scale) if softmax_scale is not None else self.head_dim ** -0.5
        self.apply_rope = True
        self.max_positions: int | None = None  # the model's max_sequence_length (prepare_model sets it)
        self._rope_device = None  # the device whose cos/sin table was reserved
        # emulated TP: RoPE and the attention run per emulated rank, on its query groups
        self.rlk_tp_emulate = tp_emulate.emulation(config, getattr(config, "tensor_model_parallel_size", 1))
        problems = config_problems(config)
        if attention_type != "self":
            problems.append(f"attention_type={attention_type!r} (rlk covers causal self-attention)")
        if attn_mask_type is not None and attn_mask_type != _compat.AttnMaskType.causal:
            problems.append(f"attn_mask_type={attn_mask_type} (rlk covers causal masks)")
        if attention_dropout:
            problems.append(f"attention_dropout={attention_dropout}")
        if problems:
            _state.get().refuse("attention", "RlkCoreAttention: " + "; ".join(problems))
            raise _compat_error("attention", problems)

    def _cp_group(self) -> tuple:
        """``(group, size)`` of the CP group (None, 1 without one); the size is read once per group object
        (a ProcessGroup's ``size()`` is a C++ call per use otherwise)."""
        g = getattr(self.pg_collection, "cp", None) if self.pg_collection is not None else None
        if g is None:
            g = _compat.parallel_state.get_context_parallel_group()
        cached = self.__dict__.get("_rlk_cp")
        if cached is None or cached[0] is not g:
            cached = self.__dict__["_rlk_cp"] = (g, g.size() if g is not None else 1)
        return cached

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None, **kwargs):
        routes = _state.get().routes
        if attention_bias is not None:
            _unsupported("attention_bias is not covered")
        if attn_mask_type is not None and attn_mask_type != _compat.AttnMaskType.causal:
            _unsupported(f"attn_mask_type={attn_mask_type} at call time")
        cp_group, cp = self._cp_group()
        with routes.scope("attention"):
            if packed_seq_params is None:
                if cp > 1:
                    _unsupported("context parallelism needs packed THD batches")
                sq, b, hq, d = query.shape
                q, k, v = (x.transpose(0, 1).reshape(b * sq, x.shape[2], d) for x in (query, key, value))
                batch = _batch_index(("sbhd", b, sq), (attention_mask,),
                                     lambda: _sbhd_batch(attention_mask, b, sq, q.device), cp, cp_group, q.device)
            else:
                if packed_seq_params.qkv_format != "thd":
                    _unsupported(f"packed qkv_format={packed_seq_params.qkv_format!r}")
                p = packed_seq_params
                batch = _batch_index(("thd",), (p.cu_seqlens_q, getattr(p, "cu_seqlens_kv", None),
                                                getattr(p, "cu_seqlens_q_padded", None),
                                                getattr(p, "cu_seqlens_kv_padded", None)),
                                     lambda: _packed_batch(p, query.shape[0], cp, cp_group, query.device),
                                     cp, cp_group, query.device)
                q, k, v = query, key, value
            if self.apply_rope:
                self._check_rope(q, batch.longest)
            if cp == 1 and self.rlk_tp_emulate is not None:
                o = tp_emulate.attention_ranks(self.rlk_tp_emulate, q, k, v, lambda *a: self._attend(batch, *a))
            elif cp > 1:
                if self.apply_rope:
                    q = routes.call("attention", "rope", q, batch.pos, self.rope_theta)
                    k = routes.call("attention", "rope", k, batch.pos, self.rope_theta)
                k, v = rlk_collectives.cp_all_gather_kv(k, v, batch.layout, cp_group, check=self.rlk_check_collectives)
                o = routes.call("attention", "attention_varlen", q, k, v, batch.cu_q, batch.cu_k, self.scale,
                                causal=True, q_positions=batch.pos)
            else:
                o = self._attend(batch, q, k, v)
        if packed_seq_params is None:
            return o.reshape(b, sq, -1).transpose(0, 1)
        return o.reshape(o.shape[0], -1)

    def _attend(self, batch: _Batch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """RoPE (where it applies) and causal ``attention_varlen`` of one packed batch, CP 1 (inside the scope)."""
        routes = _state.get().routes
        if self.apply_rope:
            q = routes.call("attention", "rope", q, batch.pos, self.rope_theta)
            k = routes.call("attention", "rope", k, batch.pos, self.rope_theta)
        return routes.call("attention", "attention_varlen", q, k, v, batch.cu_q, batch.cu_q, self.scale, causal=True)

    def _check_rope(self, q: Tensor, longest: int) -> None:
        """Refuse a batch longer than the model's maximum length; on the first call on a device, reserve the
        rope table for that length (then no rope call sizes it from the positions: no host sync)."""
        if self.max_positions is None:
            if not _UNRESERVED_NOTED:
                _UNRESERVED_NOTED.append(True)
                _state.log.warning("rlk-megatron-provider: RlkCoreAttention without max_positions (prepare_model "
                                   "was not called on the model): rope sizes its cos/sin table from the positions "
                                   "of every call, one host sync each")
            return
        if longest > self.max_positions:
            _unsupported(f"a sequence of {longest} tokens is longer than the model's max_sequence_length "
                         f"{self.max_positions} (the rope table is reserved for that many positions)")
        if self._rope_device != q.device:
            reserve_tables(q.device, q.shape[-1], self.rope_theta, self.max_positions)
            self._rope_device = q.device


_UNRESERVED_NOTED: list[bool] = []  # the warning for a model without max_positions: once per process


@dataclass
class _Batch:
    """What every layer's core attention derives from one batch's ``cu_seqlens``: token positions (global
    ones under CP), the int32 offsets on the device and the zigzag layout."""

    key: tuple
    tensors: tuple  # the cu_seqlens tensors the key names by identity, held so their ids stay unique
    pos: Tensor
    cu_q: Tensor
    cu_k: Tensor
    layout: rlk_collectives.ZigzagLayout | None
    longest: int  # the longest sequence (tokens): the rope table must cover its positions


_BATCH: list[_Batch] = []  # the newest batch only (all layers of a forward / backward see the same one)


def _batch_index(kind: tuple, tensors: tuple, build, cp: int, cp_group, device) -> _Batch:
    """The :class:`_Batch` of this call, built (``build()``: positions, offsets, layout, longest sequence)
    once per batch rather than once per layer: only when the tensors passed are not the very ones (same
    objects, same version counters) of the cached batch."""
    idents = []  # a loop, not a generator: no Python call per tensor (this runs in every layer)
    for t in tensors:
        idents.append(None if t is None else (id(t), t._version))
    key = (*kind, tuple(idents), cp, (id(cp_group), cp_group.rank()) if cp > 1 else None, device)
    if _BATCH and _BATCH[0].key == key:
        return _BATCH[0]
    pos, cu_q, cu_k, layout, longest = build()
    _BATCH[:] = [_Batch(key, tensors, pos, cu_q, cu_k, layout, longest)]
    return _BATCH[0]


def _sbhd_batch(mask: Tensor | None, b: int, sq: int, device) -> tuple:
    """``b`` rows of ``sq`` tokens, each a sequence from position 0: offsets and positions made on the device
    (no host data to copy); the causal mask checked (one host read per mask object)."""
    _check_causal_mask(mask, sq)
    cu = torch.arange(0, b * sq + 1, sq, dtype=torch.int32, device=device) if sq else \
        torch.zeros(b + 1, dtype=torch.int32, device=device)
    pos = torch.arange(sq, device=device).repeat(b)
    return pos, cu, cu, None, sq


def _packed_batch(p, total: int, cp: int, cp_group, device) -> tuple:
    """A packed THD batch: ``cu_seqlens_q`` read to the host once (the batch's one host sync) and checked
    there; positions and offsets built on the device from the given tensor."""
    cu = [int(c) for c in p.cu_seqlens_q.tolist()]
    _check_packed(p, cu, total * cp)
    longest = max((e - s for s, e in zip(cu[:-1], cu[1:])), default=0)
    given = p.cu_seqlens_q  # copied on the device (one kernel, no sync): the caller may reuse its buffer in place
    cu_k = given.to(device=device, dtype=torch.int32, non_blocking=given.is_pinned(), copy=True).contiguous()
    if cp > 1:
        layout = rlk_collectives.ZigzagLayout.build(cu, cp, device)
        return layout.q_positions(cp_group.rank()), torch.div(cu_k, cp, rounding_mode="floor"), cu_k, layout, longest
    return _positions(cu_k, total), cu_k, cu_k, None, longest


def _unsupported(reason: str) -> None:
    """A batch the installed R attention cannot compute: always an error (there is no production layer to
    fall back to at call time, and running rlk on it would break the contract)."""
    raise RlkPolicyError(f"rlk-megatron-provider, module 'attention': {reason}")


def _compat_error(module: str, problems: list[str]) -> Exception:
    # reached only in audit mode, where the spec should not have placed this class
    return RlkPolicyError(f"{module}: RlkCoreAttention placed although its R route fell back: "
                                 + "; ".join(problems))


def _check_causal_mask(mask: Tensor | None, sq: int) -> None:
    """sbhd batches: only ``None`` or Megatron's causal mask (True = masked) is the rlk contract."""
    if mask is None:
        return
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=mask.device), diagonal=1)
    if mask.dtype != torch.bool or not bool((mask == causal).all()):
        _unsupported("an attention_mask other than the causal mask (padding masks are not "
                                         "covered; pack the batch as THD instead)")


def _check_packed(p, cu: list[int], total: int) -> None:
    """``cu`` (``cu_seqlens_q`` on the host): offsets from 0, non-decreasing, ending at the batch's
    ``total`` tokens (global ones under CP); the other offset fields, where they are other tensors (each one
    more host read), equal to it."""
    if not cu or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        _unsupported(f"cu_seqlens_q must run from 0 to the {total} packed tokens, non-decreasing; got "
                     f"{cu[:6]}{'...' if len(cu) > 6 else ''}{cu[-1:] if len(cu) > 6 else ''}")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        t = getattr(p, name, None)
        if t is None or t is p.cu_seqlens_q:
            continue
        if [int(c) for c in t.tolist()] != cu:
            _unsupported("cu_seqlens_kv != cu_seqlens_q (cross/prefix attention) is not covered"
                         if name == "cu_seqlens_kv" else
                         f"{name} differs from cu_seqlens_q (padded THD) and is not covered")
