"""Issue 36: the Hugging Face Qwen3-MoE <-> Megatron weight converter (``rlk_megatron_provider.weights``), both ways,
every (EP, TP) split and both expert layouts (``GroupedMLP`` / rlk's experts, ``SequentialMLP``): exact round trips.
Pure tensor reshuffling: no megatron import."""

from __future__ import annotations

import pytest
import torch

from rlk_megatron_provider.weights import from_megatron, hf_from_megatron, to_megatron
from rlk_repro.model.config import PRESETS
from rlk_repro.model.weights import from_hf, random_weights, to_hf

CFG = PRESETS["qwen3-moe-tiny"]
SPLITS = [(ep, tp, layout) for layout in ("grouped", "sequential") for ep in (1, 2, 4, 8) for tp in (1, 2)
          if not (layout == "grouped" and tp > 1 and ep > 1)]


def _shards(w, ep: int, tp: int, layout: str):
    return [to_megatron(CFG, w, tp, r, ep=ep, ep_rank=q, experts=layout) for q in range(ep) for r in range(tp)]


@pytest.mark.parametrize(("ep", "tp", "layout"), SPLITS, ids=[f"ep{e}-tp{t}-{x}" for e, t, x in SPLITS])
def test_hf_to_megatron_to_hf_is_exact(ep, tp, layout):
    w = random_weights(CFG, 11)
    hf = to_hf(CFG, w)
    shards = _shards(from_hf(CFG, hf), ep, tp, layout)
    back = from_megatron(CFG, shards, ep=ep, experts=layout)
    assert set(back) == set(w) and all(torch.equal(back[k], w[k]) for k in w)
    streamed = dict(hf_from_megatron(CFG, shards, ep=ep, experts=layout))
    assert set(streamed) == set(hf) and all(torch.equal(streamed[k], hf[k]) for k in hf)


def test_the_megatron_layouts_are_megatron_s():
    """What megatron-core's modules read: ``GroupedMLP`` views ``weight1`` as ``[E_l, H, 2I]`` (``x @ w1[e]``) and
    ``weight2`` as ``[E_l, I, H]``; ``SequentialMLP``'s expert ``j`` on EP rank ``q`` is global expert ``q*E/ep + j``;
    the router is replicated."""
    w = random_weights(CFG, 12)
    e, h, i = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size
    m = "decoder.layers.1.mlp."
    g = to_megatron(CFG, w, ep=2, ep_rank=1, experts="grouped")
    assert g[m + "experts.weight1"].shape == (h, e // 2 * 2 * i) and g[m + "experts.weight2"].shape == (e // 2 * i, h)
    w1 = g[m + "experts.weight1"].view(e // 2, h, -1)
    w2 = g[m + "experts.weight2"].view(e // 2, -1, h)
    assert torch.equal(w1[1], w["layers.1.w13"][e // 2 + 1].t())  # so x @ w1[e] is x @ [gate; up]^T
    assert torch.equal(w2[0], w["layers.1.w2"][e // 2].t())
    s = to_megatron(CFG, w, 2, 1, ep=4, ep_rank=3, experts="sequential")
    fc1 = s[m + "experts.local_experts.1.linear_fc1.weight"]
    gate, up = w["layers.1.w13"][7].split([i, i])
    assert torch.equal(fc1, torch.cat([gate[i // 2:], up[i // 2:]]))  # TP rank 1's half of gate, then of up
    assert torch.equal(s[m + "router.weight"], w["layers.1.router"])
    assert not any("linear_fc1" in k and "experts" not in k for k in s)  # no dense FFN in an MoE layer


@pytest.mark.parametrize(("kw", "match"), [(dict(ep=3), "divisible by expert-parallel"),
                                           (dict(tp=2, ep=2, experts="grouped"), "expert TP 1"),
                                           (dict(experts="te"), "not one of")])
def test_bad_splits_are_refused(kw, match):
    w = random_weights(CFG, 1)
    with pytest.raises(ValueError, match=match):
        to_megatron(CFG, w, **kw)
    with pytest.raises(ValueError, match="dense model"):
        to_megatron(PRESETS["tiny"], random_weights(PRESETS["tiny"], 1), ep=2)
