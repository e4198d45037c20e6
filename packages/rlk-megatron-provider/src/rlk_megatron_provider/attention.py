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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlk_collectives
from rlk_core.errors import RlkPolicyError
from rlk_megatron_provider import _compat, _state
from rlk_megatron_provider.layers import RlkQKVLinear

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
    """``SelfAttention`` that leaves RoPE to :class:`RlkCoreAttention` (rlk's RoPE, not Megatron's)."""

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        if args:
            raise TypeError("RlkSelfAttention takes hidden_states and attention_mask positionally, the rest "
                            "by keyword")
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            _unsupported("Megatron inference contexts (KV cache) are not covered")
        rotary = kwargs.pop("rotary_pos_emb", None)
        self.core_attention.apply_rope = rotary is not None
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


def _positions(cu: list[int], device) -> Tensor:
    return torch.cat([torch.arange(e - s, device=device) for s, e in zip(cu[:-1], cu[1:])]) if cu[-1] else \
        torch.zeros(0, dtype=torch.int64, device=device)


class RlkCoreAttention(_compat.MegatronModule):
    """The spec's ``core_attention``: constructed and called as Megatron's core attentions are
    (unknown keyword arguments accepted and ignored), plus ``rope_theta`` from the spec's params."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, *, rope_theta: float, **kwargs):
        super().__init__(config=config)
        self.layer_number, self.rope_theta = layer_number, float(rope_theta)
        self.pg_collection = pg_collection
        self.head_dim = config.kv_channels
        self.scale = float(softmax_scale) if softmax_scale is not None else self.head_dim ** -0.5
        self.apply_rope = True
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

    def _cp_group(self):
        g = getattr(self.pg_collection, "cp", None) if self.pg_collection is not None else None
        return g if g is not None else _compat.parallel_state.get_context_parallel_group()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None, **kwargs):
        routes = _state.get().routes
        if attention_bias is not None:
            _unsupported("attention_bias is not covered")
        if attn_mask_type is not None and attn_mask_type != _compat.AttnMaskType.causal:
            _unsupported(f"attn_mask_type={attn_mask_type} at call time")
        cp_group = self._cp_group()
        cp = cp_group.size() if cp_group is not None else 1
        if packed_seq_params is None:
            if cp > 1:
                _unsupported("context parallelism needs packed THD batches")
            sq, b, hq, d = query.shape
            q, k, v = (x.transpose(0, 1).reshape(b * sq, x.shape[2], d) for x in (query, key, value))
            cu = list(range(0, b * sq + 1, sq)) if sq else [0] * (b + 1)
            with routes.scope("attention"):
                batch = _batch_index(("sbhd", tuple(cu)), (attention_mask,),
                                     lambda: _check_causal_mask(attention_mask, sq) or cu, cp, cp_group, q.device)
        else:
            if packed_seq_params.qkv_format != "thd":
                _unsupported(f"packed qkv_format={packed_seq_params.qkv_format!r}")
            tensors = tuple(getattr(packed_seq_params, n, None) for n in _CU_FIELDS)
            with routes.scope("attention"):
                batch = _batch_index(("thd",), tensors, lambda: _packed_cu(packed_seq_params), cp, cp_group,
                                     query.device)
            q, k, v = query, key, value
        with routes.scope("attention"):
            if self.apply_rope:
                q = routes.call("attention", "rope", q, batch.pos, self.rope_theta)
                k = routes.call("attention", "rope", k, batch.pos, self.rope_theta)
            if cp > 1:
                k, v = rlk_collectives.cp_all_gather_kv(k, v, batch.layout, cp_group)
                o = routes.call("attention", "attention_varlen", q, k, v, batch.cu_q, batch.cu_k, self.scale,
                                causal=True, q_positions=batch.pos)
            else:
                o = routes.call("attention", "attention_varlen", q, k, v, batch.cu_q, batch.cu_q, self.scale,
                                causal=True)
        if packed_seq_params is None:
            return o.reshape(b, sq, -1).transpose(0, 1)
        return o.reshape(o.shape[0], -1)


_CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


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


_BATCH: list[_Batch] = []  # the newest batch only (all layers of a forward / backward see the same one)


def _batch_index(kind: tuple, tensors: tuple, read_cu, cp: int, cp_group, device) -> _Batch:
    """The :class:`_Batch` of this call, built once per batch rather than once per layer: the packed
    ``cu_seqlens`` are read to the host (a device sync) and checked only when the tensors passed are not
    the very ones (same objects, same version counters) of the cached batch (an sbhd batch's causal mask
    is checked once per mask the same way)."""
    key = (*kind, tuple((id(t), t._version) if t is not None else None for t in tensors), cp,
           (id(cp_group), cp_group.rank()) if cp > 1 else None, str(device))
    if _BATCH and _BATCH[0].key == key:
        return _BATCH[0]
    cu = read_cu()
    if cp > 1:
        layout = rlk_collectives.ZigzagLayout.build(cu, cp, device)
        pos = layout.q_positions(cp_group.rank())
        cu_q = torch.tensor(layout.local_cu_seqlens, dtype=torch.int32, device=device)
        cu_k = torch.tensor(cu, dtype=torch.int32, device=device)
    else:
        layout, pos = None, _positions(cu, device)
        cu_q = cu_k = torch.tensor(cu, dtype=torch.int32, device=device)
    _BATCH[:] = [_Batch(key, tensors, pos, cu_q, cu_k, layout)]
    return _BATCH[0]


def _packed_cu(p) -> list[int]:
    cu = [int(c) for c in p.cu_seqlens_q.tolist()]
    _check_packed(p, cu)
    return cu


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


def _check_packed(p, cu: list[int]) -> None:
    kv = p.cu_seqlens_kv
    if kv is not None and [int(c) for c in kv.tolist()] != cu:
        _unsupported("cu_seqlens_kv != cu_seqlens_q (cross/prefix attention) is not covered")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        t = getattr(p, name, None)
        if t is not None and [int(c) for c in t.tolist()] != cu:
            _unsupported(f"{name} differs from cu_seqlens_q (padded THD) and is not covered")
