"""Weight layout converter: rlk-repro's local / Hugging Face Qwen3 layout <-> Megatron ``GPTModel``.

:func:`hf_from_megatron` streams the Hugging Face names and tensors of a Megatron model (all TP shards) for a
rollout engine's in-place weight update (``rlk_vllm_plugin.weight_sync``).

Pure tensor reshuffling (exact; no arithmetic, no megatron import). Megatron's layout per TP rank:

- ``linear_qkv`` rows grouped by query group: for each KV head ``g``, its ``Hq/Hkv`` query heads, then
  its key head, then its value head; TP rank ``r`` holds groups ``r*G/tp .. (r+1)*G/tp - 1``;
- ``linear_fc1`` rows ``[gate_r; up_r]`` on rank ``r`` (stride-2 sharding of ``[gate; up]``);
- ``linear_proj`` / ``linear_fc2`` columns, embedding / ``output_layer`` rows, split contiguously;
- norms (and q/k norms) replicated.
"""

from __future__ import annotations

import torch

Weights = dict[str, torch.Tensor]


def _shape(cfg) -> tuple[int, int, int, int]:
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size


def _check_tp(cfg, tp: int) -> None:
    hq, hkv, _, i = _shape(cfg)
    for name, n in (("num_key_value_heads", hkv), ("num_attention_heads", hq), ("intermediate_size", i),
                    ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by tensor-parallel size {tp}")


def qkv_to_megatron(qkv: torch.Tensor, cfg) -> torch.Tensor:
    hq, hkv, d, _ = _shape(cfg)
    r = hq // hkv
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d])
    q = q.reshape(hkv, r * d, -1)
    return torch.cat([q, k.reshape(hkv, d, -1), v.reshape(hkv, d, -1)], dim=1).reshape(qkv.shape)


def qkv_from_megatron(qkv: torch.Tensor, cfg) -> torch.Tensor:
    hq, hkv, d, _ = _shape(cfg)
    r = hq // hkv
    g = qkv.reshape(hkv, (r + 2) * d, -1)
    q, k, v = g.split([r * d, d, d], dim=1)
    return torch.cat([q.reshape(hq * d, -1), k.reshape(hkv * d, -1), v.reshape(hkv * d, -1)])


def to_megatron(cfg, weights: Weights, tp: int = 1, rank: int = 0) -> Weights:
    """The state dict of TP rank ``rank`` of ``tp`` for a ``GPTModel`` built from ``cfg``."""
    _check_tp(cfg, tp)
    i = cfg.intermediate_size

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[rank].contiguous()

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[rank].contiguous()

    out = {"embedding.word_embeddings.weight": rows(weights["embed"]),
           "decoder.final_layernorm.weight": weights["norm"].clone()}
    for n in range(cfg.num_hidden_layers):
        p, m = f"layers.{n}.", f"decoder.layers.{n}."
        gate, up = weights[p + "gate_up"].split([i, i])
        out.update({
            m + "input_layernorm.weight": weights[p + "input_norm"].clone(),
            m + "self_attention.linear_qkv.weight": rows(qkv_to_megatron(weights[p + "qkv"], cfg)),
            m + "self_attention.q_layernorm.weight": weights[p + "q_norm"].clone(),
            m + "self_attention.k_layernorm.weight": weights[p + "k_norm"].clone(),
            m + "self_attention.linear_proj.weight": cols(weights[p + "o"]),
            m + "pre_mlp_layernorm.weight": weights[p + "post_norm"].clone(),
            m + "mlp.linear_fc1.weight": torch.cat([rows(gate), rows(up)]),
            m + "mlp.linear_fc2.weight": cols(weights[p + "down"]),
        })
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = rows(weights["lm_head"])
    return out


def from_megatron(cfg, shards: list[Weights]) -> Weights:
    """The local layout from the state dicts of all TP ranks (in rank order)."""
    tp = len(shards)
    _check_tp(cfg, tp)

    def rows(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards])

    def cols(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards], dim=1)

    first = shards[0]
    out = {"embed": rows("embedding.word_embeddings.weight"), "norm": first["decoder.final_layernorm.weight"]}
    for n in range(cfg.num_hidden_layers):
        p, m = f"layers.{n}.", f"decoder.layers.{n}."
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out.update({
            p + "input_norm": first[m + "input_layernorm.weight"],
            p + "qkv": qkv_from_megatron(rows(m + "self_attention.linear_qkv.weight"), cfg),
            p + "q_norm": first[m + "self_attention.q_layernorm.weight"],
            p + "k_norm": first[m + "self_attention.k_layernorm.weight"],
            p + "o": cols(m + "self_attention.linear_proj.weight"),
            p + "post_norm": first[m + "pre_mlp_layernorm.weight"],
            p + "gate_up": torch.cat([g for g, _ in fc1] + [u for _, u in fc1]),
            p + "down": cols(m + "mlp.linear_fc2.weight"),
        })
    if not cfg.tie_word_embeddings:
        out["lm_head"] = rows("output_layer.weight")
    return out


def hf_from_megatron(cfg, shards: list[Weights]):
    """``(Hugging Face name, tensor)`` pairs of the whole model, layer by layer, from the state dicts of all TP
    ranks (in rank order): what a rollout engine's Qwen3 ``load_weights`` takes (``q/k/v_proj``,
    ``gate/up_proj`` unfused; no ``lm_head.weight`` when the head is tied to the embedding). A generator, so
    one layer's full tensors exist at a time. Exact: slices and concatenations of the shards only."""
    tp = len(shards)
    _check_tp(cfg, tp)
    hq, hkv, d, i = _shape(cfg)

    def rows(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards]) if tp > 1 else shards[0][key]

    def cols(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards], dim=1) if tp > 1 else shards[0][key]

    first = shards[0]
    yield "model.embed_tokens.weight", rows("embedding.word_embeddings.weight")
    for n in range(cfg.num_hidden_layers):
        s, m = f"model.layers.{n}.", f"decoder.layers.{n}."
        q, k, v = qkv_from_megatron(rows(m + "self_attention.linear_qkv.weight"), cfg).split([hq * d, hkv * d, hkv * d])
        fc1 = [t[m + "mlp.linear_fc1.weight"].chunk(2) for t in shards]
        yield s + "input_layernorm.weight", first[m + "input_layernorm.weight"]
        yield s + "self_attn.q_proj.weight", q
        yield s + "self_attn.k_proj.weight", k
        yield s + "self_attn.v_proj.weight", v
        yield s + "self_attn.q_norm.weight", first[m + "self_attention.q_layernorm.weight"]
        yield s + "self_attn.k_norm.weight", first[m + "self_attention.k_layernorm.weight"]
        yield s + "self_attn.o_proj.weight", cols(m + "self_attention.linear_proj.weight")
        yield s + "post_attention_layernorm.weight", first[m + "pre_mlp_layernorm.weight"]
        yield s + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1])
        yield s + "mlp.up_proj.weight", torch.cat([u for _, u in fc1])
        yield s + "mlp.down_proj.weight", cols(m + "mlp.linear_fc2.weight")
    yield "model.norm.weight", first["decoder.final_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", rows("output_layer.weight")
