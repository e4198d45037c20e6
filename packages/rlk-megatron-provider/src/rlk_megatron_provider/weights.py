"""Weight layout converter: rlk-repro's local / Hugging Face Qwen3 layout <-> Megatron ``GPTModel``.

:func:`hf_from_megatron` streams the Hugging Face names and tensors of a Megatron model (all TP shards) for a
rollout engine's in-place weight update (``rlk_vllm_plugin.weight_sync``).

Pure tensor reshuffling (exact; no arithmetic, no megatron import). Megatron's layout per TP rank:

- ``linear_qkv`` rows grouped by query group: for each KV head ``g``, its ``Hq/Hkv`` query heads, then
  its key head, then its value head; TP rank ``r`` holds groups ``r*G/tp .. (r+1)*G/tp - 1``;
- ``linear_fc1`` rows ``[gate_r; up_r]`` on rank ``r`` (stride-2 sharding of ``[gate; up]``);
- ``linear_proj`` / ``linear_fc2`` columns, embedding / ``output_layer`` rows, split contiguously;
- norms (and q/k norms) replicated.

A Qwen3-MoE layer (``cfg.num_experts > 0``; issue 36) has ``mlp.router.weight [E, H]`` (replicated) and its experts,
expert-parallel rank ``q`` of ``ep`` holding experts ``q*E/ep .. (q+1)*E/ep - 1`` (numbered from 0 there), in one of the
two layouts of megatron-core's expert modules (``experts=``):

- ``"grouped"`` (``GroupedMLP``, and rlk's experts module, which keeps its parameters): ``mlp.experts.weight1 [H,
  E_l*2I]``, the memory of ``[E_l, H, 2I]`` (expert ``e``'s ``[gate; up]^T``; ``GroupedMLP`` views it so), and
  ``mlp.experts.weight2 [E_l*I, H]`` (expert ``e``'s ``down^T`` rows ``e*I .. (e+1)*I - 1``); expert TP 1 only;
- ``"sequential"`` (``SequentialMLP``): ``mlp.experts.local_experts.<i>.linear_fc1.weight [2I, H]`` and
  ``linear_fc2.weight [H, I]``, sharded over the expert-TP ranks as the dense ``linear_fc1`` / ``linear_fc2`` (expert TP
  = TP, megatron-core's default).

The state dicts of a run are listed EP-major: ``shards[q * tp + r]`` is EP rank ``q``, TP rank ``r`` (the dense
parameters are the same on every EP rank; EP rank 0's are read).
"""

from __future__ import annotations

import torch

Weights = dict[str, torch.Tensor]


def _shape(cfg) -> tuple[int, int, int, int]:
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size


EXPERT_LAYOUTS = ("grouped", "sequential")


def _moe(cfg) -> bool:
    return getattr(cfg, "num_experts", 0) > 0


def _check_tp(cfg, tp: int, ep: int = 1, experts: str = "grouped") -> None:
    hq, hkv, _, i = _shape(cfg)
    ffn = ("moe_intermediate_size", cfg.moe_intermediate_size) if _moe(cfg) else ("intermediate_size", i)
    for name, n in (("num_key_value_heads", hkv), ("num_attention_heads", hq), ffn, ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by tensor-parallel size {tp}")
    if ep != 1 and not _moe(cfg):
        raise ValueError(f"expert-parallel size {ep} for a dense model")
    if _moe(cfg):
        if experts not in EXPERT_LAYOUTS:
            raise ValueError(f"experts={experts!r} is not one of {', '.join(EXPERT_LAYOUTS)}")
        if ep < 1 or cfg.num_experts % ep:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by expert-parallel size {ep}")
        if experts == "grouped" and tp != 1 and ep != 1:
            raise ValueError(f"the grouped expert layout is converted at TP 1 with EP {ep}, or at EP 1 (expert TP 1: "
                             f"every TP rank holds the whole experts), not TP {tp}")


def _experts_to_megatron(cfg, w13: torch.Tensor, w2: torch.Tensor, m: str, tp: int, rank: int, ep: int,
                         ep_rank: int, experts: str) -> Weights:
    """One MoE layer's local experts on (EP rank ``ep_rank``, TP rank ``rank``)."""
    n = cfg.num_experts // ep
    local = range(ep_rank * n, (ep_rank + 1) * n)
    x = m + "mlp.experts."
    if experts == "grouped":
        h = w13.shape[2]
        return {x + "weight1": torch.stack([w13[e].t() for e in local]).reshape(h, -1).contiguous(),
                x + "weight2": torch.cat([w2[e].t() for e in local]).contiguous()}
    i = cfg.moe_intermediate_size
    out = {}
    for j, e in enumerate(local):
        gate, up = w13[e].split([i, i])
        out[f"{x}local_experts.{j}.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        out[f"{x}local_experts.{j}.linear_fc2.weight"] = w2[e].chunk(tp, dim=1)[rank].contiguous()
    return out


def _experts_from_megatron(cfg, shards: list[Weights], m: str, tp: int, ep: int, experts: str
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` from every (EP, TP) rank's state dict."""
    n, i, x = cfg.num_experts // ep, cfg.moe_intermediate_size, m + "mlp.experts."
    w13, w2 = [], []
    for q in range(ep):
        part = shards[q * tp:(q + 1) * tp]
        if experts == "grouped":
            h = part[0][x + "weight1"].shape[0]
            w13 += list(part[0][x + "weight1"].reshape(n, h, 2 * i).transpose(1, 2))
            w2 += list(part[0][x + "weight2"].reshape(n, i, h).transpose(1, 2))
            continue
        for j in range(n):
            fc1 = [s[f"{x}local_experts.{j}.linear_fc1.weight"].chunk(2) for s in part]
            w13.append(torch.cat([g for g, _ in fc1] + [u for _, u in fc1]))
            w2.append(torch.cat([s[f"{x}local_experts.{j}.linear_fc2.weight"] for s in part], dim=1))
    return torch.stack(w13).contiguous(), torch.stack(w2).contiguous()


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


def to_megatron(cfg, weights: Weights, tp: int = 1, rank: int = 0, *, ep: int = 1, ep_rank: int = 0,
                experts: str = "grouped") -> Weights:
    """The state dict of TP rank ``rank`` of ``tp`` (an MoE model: and EP rank ``ep_rank`` of ``ep``, its experts in
    the layout ``experts``) for a ``GPTModel`` built from ``cfg``."""
    _check_tp(cfg, tp, ep, experts)
    i = cfg.intermediate_size

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[rank].contiguous()

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[rank].contiguous()

    out = {"embedding.word_embeddings.weight": rows(weights["embed"]),
           "decoder.final_layernorm.weight": weights["norm"].clone()}
    for n in range(cfg.num_hidden_layers):
        p, m = f"layers.{n}.", f"decoder.layers.{n}."
        out.update({
            m + "input_layernorm.weight": weights[p + "input_norm"].clone(),
            m + "self_attention.linear_qkv.weight": rows(qkv_to_megatron(weights[p + "qkv"], cfg)),
            m + "self_attention.q_layernorm.weight": weights[p + "q_norm"].clone(),
            m + "self_attention.k_layernorm.weight": weights[p + "k_norm"].clone(),
            m + "self_attention.linear_proj.weight": cols(weights[p + "o"]),
            m + "pre_mlp_layernorm.weight": weights[p + "post_norm"].clone(),
        })
        if _moe(cfg):
            out[m + "mlp.router.weight"] = weights[p + "router"].clone()
            out.update(_experts_to_megatron(cfg, weights[p + "w13"], weights[p + "w2"], m, tp, rank, ep, ep_rank,
                                            experts))
            continue
        gate, up = weights[p + "gate_up"].split([i, i])
        out.update({m + "mlp.linear_fc1.weight": torch.cat([rows(gate), rows(up)]),
                    m + "mlp.linear_fc2.weight": cols(weights[p + "down"])})
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = rows(weights["lm_head"])
    return out


def from_megatron(cfg, shards: list[Weights], *, ep: int = 1, experts: str = "grouped") -> Weights:
    """The local layout from the state dicts of all TP ranks (in rank order; an MoE model's: of all (EP, TP) ranks,
    EP-major)."""
    if len(shards) % ep:
        raise ValueError(f"{len(shards)} state dicts are not a whole number of EP ranks ({ep})")
    tp = len(shards) // ep
    _check_tp(cfg, tp, ep, experts)
    every = shards
    shards = shards[:tp]

    def rows(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards])

    def cols(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in shards], dim=1)

    first = shards[0]
    out = {"embed": rows("embedding.word_embeddings.weight"), "norm": first["decoder.final_layernorm.weight"]}
    for n in range(cfg.num_hidden_layers):
        p, m = f"layers.{n}.", f"decoder.layers.{n}."
        out.update({
            p + "input_norm": first[m + "input_layernorm.weight"],
            p + "qkv": qkv_from_megatron(rows(m + "self_attention.linear_qkv.weight"), cfg),
            p + "q_norm": first[m + "self_attention.q_layernorm.weight"],
            p + "k_norm": first[m + "self_attention.k_layernorm.weight"],
            p + "o": cols(m + "self_attention.linear_proj.weight"),
            p + "post_norm": first[m + "pre_mlp_layernorm.weight"],
        })
        if _moe(cfg):
            out[p + "router"] = first[m + "mlp.router.weight"]
            out[p + "w13"], out[p + "w2"] = _experts_from_megatron(cfg, every, m, tp, ep, experts)
            continue
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out.update({p + "gate_up": torch.cat([g for g, _ in fc1] + [u for _, u in fc1]),
                    p + "down": cols(m + "mlp.linear_fc2.weight")})
    if not cfg.tie_word_embeddings:
        out["lm_head"] = rows("output_layer.weight")
    return out


def hf_from_megatron(cfg, shards: list[Weights], *, ep: int = 1, experts: str = "grouped"):
    """``(Hugging Face name, tensor)`` pairs of the whole model, layer by layer, from the state dicts of all TP
    ranks (in rank order; an MoE model's: all (EP, TP) ranks, EP-major): what a rollout engine's Qwen3 / Qwen3-MoE
    ``load_weights`` takes (``q/k/v_proj``, ``gate/up_proj`` unfused, an MoE layer's ``mlp.gate`` and per-expert
    ``mlp.experts.<e>.{gate,up,down}_proj``, as the Hub's checkpoints; no ``lm_head.weight`` when the head is tied
    to the embedding). A generator, so one layer's full tensors exist at a time. Exact: slices and concatenations of
    the shards only."""
    if len(shards) % ep:
        raise ValueError(f"{len(shards)} state dicts are not a whole number of EP ranks ({ep})")
    every, tp = shards, len(shards) // ep
    shards = shards[:tp]
    _check_tp(cfg, tp, ep, experts)
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
        yield s + "input_layernorm.weight", first[m + "input_layernorm.weight"]
        yield s + "self_attn.q_proj.weight", q
        yield s + "self_attn.k_proj.weight", k
        yield s + "self_attn.v_proj.weight", v
        yield s + "self_attn.q_norm.weight", first[m + "self_attention.q_layernorm.weight"]
        yield s + "self_attn.k_norm.weight", first[m + "self_attention.k_layernorm.weight"]
        yield s + "self_attn.o_proj.weight", cols(m + "self_attention.linear_proj.weight")
        yield s + "post_attention_layernorm.weight", first[m + "pre_mlp_layernorm.weight"]
        if _moe(cfg):
            yield s + "mlp.gate.weight", first[m + "mlp.router.weight"]
            w13, w2 = _experts_from_megatron(cfg, every, m, tp, ep, experts)
            mi = cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                yield f"{s}mlp.experts.{e}.gate_proj.weight", w13[e, :mi]
                yield f"{s}mlp.experts.{e}.up_proj.weight", w13[e, mi:]
                yield f"{s}mlp.experts.{e}.down_proj.weight", w2[e]
            continue
        fc1 = [t[m + "mlp.linear_fc1.weight"].chunk(2) for t in shards]
        yield s + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1])
        yield s + "mlp.up_proj.weight", torch.cat([u for _, u in fc1])
        yield s + "mlp.down_proj.weight", cols(m + "mlp.linear_fc2.weight")
    yield "model.norm.weight", first["decoder.final_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", rows("output_layer.weight")
