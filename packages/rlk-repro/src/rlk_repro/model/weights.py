"""Weights of the local Qwen3 model: layout, random checkpoints, Hugging Face safetensors load/save.

The engine keeps the fused layout both production frameworks use (vLLM's ``qkv_proj`` /
``gate_up_proj``, Megatron's ``linear_qkv`` / ``linear_fc1``):

=========================  ==========================  ===========================================
name                       shape                       Hugging Face source
=========================  ==========================  ===========================================
``embed``                  ``[V, H]``                  ``model.embed_tokens.weight``
``layers.i.input_norm``    ``[H]``                     ``model.layers.i.input_layernorm.weight``
``layers.i.qkv``           ``[(Hq + 2 Hkv) D, H]``     ``self_attn.{q,k,v}_proj.weight`` concatenated
``layers.i.q_norm``        ``[D]``                     ``self_attn.q_norm.weight``
``layers.i.k_norm``        ``[D]``                     ``self_attn.k_norm.weight``
``layers.i.o``             ``[H, Hq D]``               ``self_attn.o_proj.weight``
``layers.i.post_norm``     ``[H]``                     ``post_attention_layernorm.weight``
``layers.i.gate_up``       ``[2 I, H]``                ``mlp.{gate,up}_proj.weight`` concatenated
``layers.i.down``          ``[H, I]``                  ``mlp.down_proj.weight``
``norm``                   ``[H]``                     ``model.norm.weight``
``lm_head``                ``[V, H]``                  ``lm_head.weight`` (absent when tied)
=========================  ==========================  ===========================================

A Qwen3-MoE layer (``cfg.is_moe``) has, instead of ``gate_up`` / ``down``, the router and the experts stacked in the
layout of vLLM's ``FusedMoE`` (``w13_weight`` / ``w2_weight``), transformers 5's ``Qwen3MoeExperts``
(``gate_up_proj`` / ``down_proj``) and rlk's ``moe_ffn``:

=========================  ==========================  ===========================================
``layers.i.router``        ``[E, H]``                  ``mlp.gate.weight``
``layers.i.w13``           ``[E, 2 I, H]``             ``mlp.experts.e.{gate,up}_proj.weight`` per expert
``layers.i.w2``            ``[E, H, I]``               ``mlp.experts.e.down_proj.weight`` per expert
=========================  ==========================  ===========================================

(``I`` = ``moe_intermediate_size``.) Checkpoints are written per expert, as the Hub's Qwen3-MoE checkpoints are;
reading also takes the stacked form (``mlp.experts.gate_up_proj`` / ``down_proj``).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlk_core.errors import RlkConfigError
from rlk_repro.model.config import RANDOM_LOGIT_STD, Qwen3Config

Weights = dict[str, torch.Tensor]


def expected_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        shapes.update({
            p + "input_norm": (h,), p + "qkv": (cfg.q_size + 2 * cfg.kv_size, h), p + "q_norm": (d,),
            p + "k_norm": (d,), p + "o": (h, cfg.q_size), p + "post_norm": (h,),
        })
        if cfg.is_moe:
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            shapes.update({p + "router": (e, h), p + "w13": (e, 2 * mi, h), p + "w2": (e, h, mi)})
        else:
            shapes.update({p + "gate_up": (2 * i, h), p + "down": (h, i)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    return shapes


def random_weights(cfg: Qwen3Config, seed: int, dtype: torch.dtype = torch.float32) -> Weights:
    """A deterministic random checkpoint (CPU generator, so the same seed gives the same bits everywhere).

    Projections ~ N(0, 0.02^2); the LM head ~ N(0, (0.5/sqrt(H))^2) (tied: the embedding's 0.02); norm weights 1,
    except the final norm's gain, which gives the logits the standard deviation
    :data:`~rlk_repro.model.config.RANDOM_LOGIT_STD`: peaked next-token distributions, neither near-uniform
    nor one-hot.
    """
    g = torch.Generator().manual_seed(int(seed))
    out: Weights = {}
    head_std = 0.02 if cfg.tie_word_embeddings else 0.5 / cfg.hidden_size**0.5
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            gain = RANDOM_LOGIT_STD / (head_std * cfg.hidden_size**0.5) if name == "norm" else 1.0
            t = torch.full(shape, gain)
        else:
            std = head_std if name == "lm_head" else 0.02
            t = torch.randn(shape, generator=g) * std
        out[name] = t.to(dtype)
    return out


def check_weights(cfg: Qwen3Config, weights: Weights) -> None:
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise RlkConfigError(f"checkpoint does not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise RlkConfigError(f"weight {name} has shape {tuple(weights[name].shape)}, config implies {shape}")


# -- Hugging Face layout ---------------------------------------------------------------------------
def from_hf(cfg: Qwen3Config, hf: Weights) -> Weights:
    def take(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError:
            raise RlkConfigError(f"checkpoint lacks tensor {name!r}") from None

    out: Weights = {"embed": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    for n in range(cfg.num_hidden_layers):
        s, p = f"model.layers.{n}.", f"layers.{n}."
        out[p + "input_norm"] = take(s + "input_layernorm.weight")
        out[p + "qkv"] = torch.cat([take(s + f"self_attn.{x}_proj.weight") for x in "qkv"])
        out[p + "q_norm"] = take(s + "self_attn.q_norm.weight")
        out[p + "k_norm"] = take(s + "self_attn.k_norm.weight")
        out[p + "o"] = take(s + "self_attn.o_proj.weight")
        out[p + "post_norm"] = take(s + "post_attention_layernorm.weight")
        if cfg.is_moe:
            out.update(_moe_from_hf(cfg, hf, take, s, p))
        else:
            out[p + "gate_up"] = torch.cat([take(s + "mlp.gate_proj.weight"), take(s + "mlp.up_proj.weight")])
            out[p + "down"] = take(s + "mlp.down_proj.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head"] = take("lm_head.weight")
    check_weights(cfg, out)
    return out


def _moe_from_hf(cfg: Qwen3Config, hf: Weights, take, s: str, p: str) -> Weights:
    """One MoE layer's router and stacked experts from the per-expert (Hub) or the stacked (transformers 5) form."""
    out = {p + "router": take(s + "mlp.gate.weight")}
    if s + "mlp.experts.gate_up_proj" in hf:
        out[p + "w13"], out[p + "w2"] = take(s + "mlp.experts.gate_up_proj"), take(s + "mlp.experts.down_proj")
        return out
    x = s + "mlp.experts."
    out[p + "w13"] = torch.stack([torch.cat([take(f"{x}{e}.gate_proj.weight"), take(f"{x}{e}.up_proj.weight")])
                                  for e in range(cfg.num_experts)])
    out[p + "w2"] = torch.stack([take(f"{x}{e}.down_proj.weight") for e in range(cfg.num_experts)])
    return out


def to_hf(cfg: Qwen3Config, weights: Weights) -> Weights:
    out: Weights = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["norm"]}
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for n in range(cfg.num_hidden_layers):
        s, p = f"model.layers.{n}.", f"layers.{n}."
        qkv = weights[p + "qkv"]
        out[s + "input_layernorm.weight"] = weights[p + "input_norm"]
        out[s + "self_attn.q_proj.weight"] = qkv[:q]
        out[s + "self_attn.k_proj.weight"] = qkv[q : q + kv]
        out[s + "self_attn.v_proj.weight"] = qkv[q + kv :]
        out[s + "self_attn.q_norm.weight"] = weights[p + "q_norm"]
        out[s + "self_attn.k_norm.weight"] = weights[p + "k_norm"]
        out[s + "self_attn.o_proj.weight"] = weights[p + "o"]
        out[s + "post_attention_layernorm.weight"] = weights[p + "post_norm"]
        if cfg.is_moe:  # per expert, as the Hub's Qwen3-MoE checkpoints
            mi = cfg.moe_intermediate_size
            out[s + "mlp.gate.weight"] = weights[p + "router"]
            for e in range(cfg.num_experts):
                x = f"{s}mlp.experts.{e}."
                out[x + "gate_proj.weight"] = weights[p + "w13"][e, :mi]
                out[x + "up_proj.weight"] = weights[p + "w13"][e, mi:]
                out[x + "down_proj.weight"] = weights[p + "w2"][e]
            continue
        out[s + "mlp.gate_proj.weight"] = weights[p + "gate_up"][:i]
        out[s + "mlp.up_proj.weight"] = weights[p + "gate_up"][i:]
        out[s + "mlp.down_proj.weight"] = weights[p + "down"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = weights["lm_head"]
    return {k: v.contiguous() for k, v in out.items()}


def save_checkpoint(path: str | os.PathLike[str], cfg: Qwen3Config, weights: Weights) -> None:
    """Write a Hugging Face directory: ``config.json`` and ``model.safetensors``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg.to_hf(), fh, indent=2)
    save_file(to_hf(cfg, weights), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[Qwen3Config, Weights]:
    """Read a Hugging Face Qwen3 directory (``config.json`` + one or more ``*.safetensors``)."""
    cfg = Qwen3Config.from_dir(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise RlkConfigError(f"{path} holds no *.safetensors files")
    hf: Weights = {}
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as fh:
            for key in fh.keys():
                hf[key] = fh.get_tensor(key)
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    return cfg, from_hf(cfg, hf)


def weights_sha256(weights: Weights) -> str:
    """``sha256:<hex>`` over names, dtypes, shapes and raw bytes in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()
