"""vLLM's ``FusedMoE`` on rlk ops (issue 36; the ``ffn`` module's MoE form, contract ``rlk.moe.v1``).

``UnquantizedFusedMoEMethod`` (a vLLM ``CustomOp``) is replaced out of tree (``CustomOp.register_oot``, as the
norms are: :mod:`rlk_vllm_plugin.layers`) by :func:`method_class`'s subclass. For an ``R`` ffn it is *monolithic*:
vLLM's runner hands it the router logits (the gate's GEMM: the rlk ``linear`` of the linear hook) and it computes
the rest as the trainer does — ``moe_topk`` (fp32 softmax, top-k with ties to the lower expert id, renormalised
for ``renormalize`` = Qwen3-MoE's ``norm_topk_prob``), the pairs sorted by (expert, token, slot), the experts'
``moe_grouped_linear`` around ``swiglu`` on vLLM's own ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]`` (the
layout rlk takes as it is), and the slot-order ``moe_combine``. The weights are left as loaded: no repacking (vLLM's
CPU path packs them for its sgl kernel) and no fused-MoE kernel set up. For a ``P`` ffn every method is vLLM's own,
unchanged, and counted as a production call.

vLLM's routed-experts record (``enable_return_routed_experts``: each sample's ``[tokens, layers, k]`` expert ids) is
filled by a capture hook its router calls from ``select_experts``; a monolithic method selects the experts itself, so
the R method hands rlk's ids to that hook (``layer.router.capture_fn``) as the router would.

What an ``R`` ffn refuses (a violation: strict raises): expert parallelism (``expert_map``), grouped top-k, a score
function other than softmax, a score-correction bias, a routed scaling factor other than 1, router weights applied
on the input, a custom routing function, an activation other than SiLU, expert biases.
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_core.ops.moe.layer import route
from rlk_vllm_plugin import _compat, _runtime

TARGET = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod"
BACKEND = "production.vllm.UnquantizedFusedMoEMethod"
OPS = ("moe_topk", "moe_grouped_linear", "moe_combine")


def problems(layer: Any) -> list[str]:
    """Why ``layer`` (a ``FusedMoE``) cannot run the rlk route (empty: it can)."""
    act = getattr(layer, "activation", "silu")
    checks = (
        (getattr(layer, "expert_map", None) is not None, "expert parallelism (expert_map)"),
        (getattr(layer, "use_grouped_topk", False), "grouped top-k"),
        (str(getattr(layer, "scoring_func", "softmax")) != "softmax", f"scoring_func={layer.scoring_func!r}"),
        (getattr(layer, "e_score_correction_bias", None) is not None, "a score-correction bias"),
        (float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0) != 1.0,
         f"routed_scaling_factor={getattr(layer, 'routed_scaling_factor', None)!r}"),
        (getattr(layer, "apply_router_weight_on_input", False), "router weights applied on the input"),
        (getattr(layer, "custom_routing_function", None) is not None, "a custom routing function"),
        ("silu" not in str(getattr(act, "value", act)).lower(), f"activation {act!r} (rlk: SwiGLU)"),
        (getattr(getattr(layer, "moe_config", None), "has_bias", False) or getattr(layer, "w13_bias", None)
         is not None, "expert biases"),
    )
    return [f"FusedMoE {getattr(layer, 'layer_name', '')}: {what} is not covered by rlk.moe.v1" for bad, what in checks
            if bad]


def rlk_experts(layer: Any, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The routed experts of one ``FusedMoE`` for ``x [T, H]`` from its router logits ``[T, E]``, on rlk ops."""
    rt = _runtime.get()
    for p in problems(layer):
        rt.violation(p)
    weights, ids = _runtime.rlk("ffn", "moe_topk", router_logits, int(layer.top_k), bool(layer.renormalize))
    capture = getattr(getattr(layer, "router", None), "capture_fn", None)
    if capture is not None:  # vLLM's routed-experts record (enable_return_routed_experts): rlk's ids, as its router's
        capture(ids)
    w13, w2 = layer.w13_weight, layer.w2_weight
    r = route(ids, weights, w13.shape[0])
    k = ids.shape[1]
    rows = x.index_select(0, torch.div(r.order, k, rounding_mode="floor"))
    h = _runtime.rlk("ffn", "moe_grouped_linear", rows, w13, r.offsets)
    o = _runtime.rlk("ffn", "moe_grouped_linear", _runtime.rlk("ffn", "swiglu", h), w2, r.offsets)
    return _runtime.rlk("ffn", "moe_combine", o.index_select(0, r.inv).view(-1, k, o.shape[1]), weights)


def method_class() -> type:
    """The out-of-tree ``UnquantizedFusedMoEMethod`` against the installed vLLM's class."""
    base = _compat.module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
                          ).UnquantizedFusedMoEMethod

    def r() -> bool:
        return _runtime.get().r("ffn")

    def production() -> None:
        for op in OPS:
            _runtime.production("ffn", op, BACKEND)

    class RlkUnquantizedFusedMoEMethod(base):
        _rlk_op, _rlk_module = "moe", "ffn"  # what layers.bind_model reads of every replaced CustomOp

        @property
        def is_monolithic(self) -> bool:
            return True if r() else base.is_monolithic.fget(self)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            if not r():
                return base.process_weights_after_loading(self, layer)
            # the weights as loaded: the base's step before vLLM's (its own first call), no packing, no kernel
            return super(base, self).process_weights_after_loading(layer)

        def apply_monolithic(self, layer, x, router_logits, input_ids=None):
            if r():
                return rlk_experts(layer, x, router_logits)
            production()
            return base.apply_monolithic(self, layer, x, router_logits, input_ids)

        def apply(self, layer, x, *args, **kwargs):
            if r():  # vLLM chose the experts itself: not rlk's top-k
                _runtime.get().violation("FusedMoE under ffn R reached UnquantizedFusedMoEMethod.apply (vLLM's own "
                                         "expert selection) instead of apply_monolithic")
            production()
            return base.apply(self, layer, x, *args, **kwargs)

    RlkUnquantizedFusedMoEMethod.__module__ = __name__
    return RlkUnquantizedFusedMoEMethod
