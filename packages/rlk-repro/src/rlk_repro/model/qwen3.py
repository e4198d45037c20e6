"""The Qwen3 decoder's blocks (dense, or Qwen3-MoE: :func:`ffn`), written once against an
:class:`~rlk_repro.model.ops.Ops` table.

Both engines call these blocks on their own token layouts (the rollout engine on a step's scheduled
tokens, the trainer on packed sequences) and supply their own attention core between
:func:`attention_qkv` and :func:`attention_out`. Embedding lookup (a gather) and residual additions
(elementwise) are exact and identical on both sides by construction.
"""

from __future__ import annotations

import torch

from rlk_repro.model.config import Qwen3Config
from rlk_repro.model.ops import Ops
from rlk_repro.model.weights import Weights


def embed(w: Weights, ids: torch.Tensor) -> torch.Tensor:
    return w["embed"][ids]


def lm_head_weight(w: Weights) -> torch.Tensor:
    return w["lm_head"] if "lm_head" in w else w["embed"]


def attention_qkv(ops: Ops, cfg: Qwen3Config, w: Weights, layer: int, h: torch.Tensor, positions: torch.Tensor):
    """Input RMSNorm, fused QKV projection, q/k RMSNorm, RoPE -> q ``[T, Hq, D]``, k, v ``[T, Hkv, D]``."""
    p = f"layers.{layer}."
    t, d = h.shape[0], cfg.head_dim
    x = ops.rms_norm("attention", h, w[p + "input_norm"], cfg.rms_norm_eps)
    qkv = ops.linear("attention", x, w[p + "qkv"])
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = ops.rms_norm("attention", q.reshape(t, cfg.num_attention_heads, d), w[p + "q_norm"], cfg.rms_norm_eps)
    k = ops.rms_norm("attention", k.reshape(t, cfg.num_key_value_heads, d), w[p + "k_norm"], cfg.rms_norm_eps)
    q = ops.rope(q, positions, cfg.rope_theta)
    k = ops.rope(k, positions, cfg.rope_theta)
    return q, k, v.reshape(t, cfg.num_key_value_heads, d).contiguous()


def attention_out(ops: Ops, w: Weights, layer: int, o: torch.Tensor) -> torch.Tensor:
    return ops.linear("attention", o.reshape(o.shape[0], -1), w[f"layers.{layer}.o"])


def ffn(ops: Ops, cfg: Qwen3Config, w: Weights, layer: int, h: torch.Tensor,
        routing: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Post-attention RMSNorm, fused gate/up projection, SwiGLU, down projection; in a Qwen3-MoE model the routed
    experts instead (:meth:`Ops.moe`), each token's selected expert ids ``[T, k]`` appended to ``routing`` if given."""
    p = f"layers.{layer}."
    x = ops.rms_norm("ffn", h, w[p + "post_norm"], cfg.rms_norm_eps)
    if cfg.is_moe:
        y, ids = ops.moe(x, w[p + "router"], w[p + "w13"], w[p + "w2"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if routing is not None:
            routing.append(ids)
        return y
    return ops.linear("ffn", ops.swiglu(ops.linear("ffn", x, w[p + "gate_up"])), w[p + "down"])


def final_norm(ops: Ops, cfg: Qwen3Config, w: Weights, h: torch.Tensor) -> torch.Tensor:
    return ops.rms_norm("logp", h, w["norm"], cfg.rms_norm_eps)
