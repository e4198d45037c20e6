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
filled by capture hooks; a monolithic method selects the experts itself, so the R method hands rlk's ids to the
layer's hook as vLLM's own kernels would (:func:`capture_hook`). The hooks differ by version (:func:`moe_site`):

- 0.22: the method is handed the ``FusedMoE``, which holds its router (``layer.router``, whose ``select_experts``
  calls ``router.capture_fn``) and ``layer_id``; the R method calls the router's hook.
- 0.33: the method is handed the ``RoutedExperts`` (the weights only); its ``MoERunner`` (the router, ``layer_id``)
  is registered under the same layer name in the compilation config's ``static_forward_context``. A modular method
  is routed by ``runner.router.select_experts`` (which calls the router's hook, as on 0.22); a monolithic one
  reports its ids through the layer's ``routing_sink`` (a ``RoutedExpertsSink``: ``capture_fn``, and a buffer that
  vLLM's replay-capable monolithic kernels write into); the R method calls the sink's ``capture_fn``.

vLLM keeps its own record to its V1 runner on 0.22, and rlk's log-probs need Model Runner V2; so, with
``RL_KERNEL_VLLM_MOE_ROUTING=1``, the plugin keeps its own (:class:`RoutingRecord`, the same on both versions): at
load time every ``FusedMoE``'s hooks (the router's, and on 0.33 a sink for a monolithic method: rlk's under R, a
replay-capable vLLM kernel's under P) are bound to write each layer's ids into one static device buffer (what a
captured CUDA graph then replays), and after every MRv2 ``execute_model`` the step's rows are filed by request id and
token position (:func:`take_routing`). Refused (a violation) where the record would be wrong or empty: vLLM's own
routed-experts capture on as well (it binds the same hooks after the load and would take them over), dual-batch
overlap (two micro-batches write the same rows), sequence-parallel MoE (a rank sees a shard of the tokens), and on
0.33 a monolithic vLLM kernel without routing replay (nothing would report its ids).

What an ``R`` ffn refuses (a violation: strict raises): expert parallelism (``expert_map``), grouped top-k, a score
function other than softmax, a score-correction bias, a routed scaling factor other than 1, router weights applied
on the input, a custom routing function, an activation other than SiLU, expert biases.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from rlk_core import envs
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
    capture = capture_hook(layer)
    if capture is not None:  # a routed-experts record (vLLM's or the plugin's): rlk's ids, as vLLM's router's
        capture(ids)
    w13, w2 = layer.w13_weight, layer.w2_weight
    r = route(ids, weights, w13.shape[0])
    k = ids.shape[1]
    rows = x.index_select(0, torch.div(r.order, k, rounding_mode="floor"))
    h = _runtime.rlk("ffn", "moe_grouped_linear", rows, w13, r.offsets)
    o = _runtime.rlk("ffn", "moe_grouped_linear", _runtime.rlk("ffn", "swiglu", h), w2, r.offsets)
    return _runtime.rlk("ffn", "moe_combine", o.index_select(0, r.inv).view(-1, k, o.shape[1]), weights)


MRV2_RUNNER = "vllm.v1.worker.gpu.model_runner"
_RECORD: list[RoutingRecord] = []  # the process's record (one engine per process), made at the first MoE layer's load


class RoutingRecord:
    """Every computed token's expert ids, per request id and position (``RL_KERNEL_VLLM_MOE_ROUTING=1``).

    ``buf [max_tokens, layers, k]`` (int32, on the experts' device) receives layer ``l``'s ``[n, k]`` ids of a
    forward in ``buf[:n, l]`` (from the routers' capture hook: a copy into a fixed buffer, so a CUDA graph replays it);
    after the step :meth:`harvest` reads the real tokens' rows with the batch's request ids, query offsets and positions
    (one device-to-host copy a step) and files them; a position computed twice (a preempted request) keeps its last
    rows."""

    def __init__(self, max_tokens: int, layers: int, top_k: int, device: torch.device) -> None:
        self.buf = torch.zeros((max_tokens, layers, top_k), dtype=torch.int32, device=device)
        self.layers = layers
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # request id -> position -> [layers, k]

    def capture(self, layer: int, ids: torch.Tensor) -> None:
        self.buf[:ids.shape[0], layer] = ids

    def harvest(self, batch: Any) -> None:
        n = int(batch.num_tokens)
        if n == 0:
            return
        rows = self.buf[:n].cpu()
        pos = batch.positions[:n].cpu()
        qsl = batch.query_start_loc_np
        for b, req in enumerate(batch.req_ids[:batch.num_reqs]):
            mine = self.rows.setdefault(req, {})
            for t in range(int(qsl[b]), int(qsl[b + 1])):
                mine[int(pos[t])] = rows[t]

    def take(self) -> dict[str, torch.Tensor | None]:
        """``{request id: [positions, layers, k] int64}`` for every request recorded since the last call (then
        forgotten; vLLM's warm-up requests included); ``None`` for a request whose positions are not 0..N-1 (a
        prefix-cache hit skips computing some: its caller refuses it)."""
        out: dict[str, torch.Tensor | None] = {}
        for req, by_pos in self.rows.items():
            ok = sorted(by_pos) == list(range(len(by_pos)))
            out[req] = torch.stack([by_pos[p] for p in range(len(by_pos))]).to(torch.int64) if ok else None
        self.rows = {}
        return out


def take_routing() -> dict[str, torch.Tensor | None]:
    """The process's MoE routing record since the last call (:meth:`RoutingRecord.take`); refused when none was made
    (``RL_KERNEL_VLLM_MOE_ROUTING`` unset, no MoE model loaded, or not Model Runner V2)."""
    if not _RECORD:
        raise RuntimeError("rlk MoE routing record: none in this process (RL_KERNEL_VLLM_MOE_ROUTING=1 and an MoE "
                           "model loaded on Model Runner V2 make one)")
    return _RECORD[0].take()


REQUEST_ID = re.compile(r"^(?:(\d+)_)?(.+)-[0-9A-Za-z]{8}$")


def request_key(req_id: str) -> tuple[str, int] | None:
    """``(external request id, sample index)`` of an engine-core request id: vLLM's ``LLM`` gives request ``r`` the id
    ``r-<8 random characters>``, and the ``n > 1`` samples ``<i>_r-<8>`` (``ParentRequest.get_child_info``); None for
    another form (vLLM's warm-up requests)."""
    m = REQUEST_ID.match(req_id)
    return None if m is None else (m.group(2), int(m.group(1) or 0))


def capture_hook(layer: Any) -> Any:
    """The routed-experts hook a monolithic method hands its ``[T, k]`` expert ids to (None: none bound): on 0.33 the
    layer's ``routing_sink.capture_fn``, on 0.22 its router's ``capture_fn``."""
    sink = getattr(layer, "routing_sink", None)
    if sink is not None:
        return sink.capture_fn
    return getattr(getattr(layer, "router", None), "capture_fn", None)


def moe_site(layer: Any) -> tuple[Any, int] | str:
    """``(router, layer index)`` of the ``FusedMoE`` whose quant method is handed ``layer``, or why none is found:
    0.22's ``FusedMoE`` holds both; 0.33's ``RoutedExperts`` is found in its ``MoERunner``, registered under the same
    layer name in the compilation config's ``static_forward_context``."""
    if hasattr(layer, "router"):  # 0.22: the FusedMoE itself
        return layer.router, int(layer.layer_id)
    name = getattr(layer, "layer_name", None)
    runner = _compat.current_vllm_config().compilation_config.static_forward_context.get(name)
    if runner is None or getattr(runner, "routed_experts", None) is not layer:
        return f"no MoE runner of {type(layer).__name__} {name!r} in the compilation config's static forward context"
    return runner.router, int(runner.layer_id)


def _record_problems(layer: Any, vc: Any) -> list[str]:
    """Why the plugin's routing record cannot be kept for ``layer`` (empty: it can)."""
    own = (getattr(vc.model_config, "enable_return_routed_experts", False)  # 0.22
           or getattr(getattr(vc, "aux_output_config", None), "enable_return_routed_experts", False))  # 0.33
    checks = (
        (own, "vLLM's own routed-experts capture (enable_return_routed_experts) binds the same hooks"),
        (getattr(vc.parallel_config, "enable_dbo", False), "dual-batch overlap (two micro-batches, one buffer)"),
        (getattr(getattr(layer, "moe_config", None), "is_sequence_parallel", False),
         "sequence-parallel MoE (a rank routes a shard of the tokens)"),
    )
    return [f"RL_KERNEL_VLLM_MOE_ROUTING: {what} is not supported" for bad, what in checks if bad]


def _bind_record(layer: Any, method: Any) -> None:
    """After a ``FusedMoE``'s weights are processed (``RL_KERNEL_VLLM_MOE_ROUTING=1``): the process's record (made at
    the first layer, sized by vLLM's batch budget and CUDA-graph sizes), the layer's hooks bound to it (the router's
    on both versions; on 0.33 a monolithic method's routing sink too), MRv2's ``execute_model`` wrapped to file each
    step's rows. Idempotent."""
    rt = _runtime.get()
    site = moe_site(layer)
    if isinstance(site, str):
        rt.violation(f"RL_KERNEL_VLLM_MOE_ROUTING: {site}")
        return
    router, index = site
    if not hasattr(router, "set_capture_fn"):
        rt.violation(f"RL_KERNEL_VLLM_MOE_ROUTING: {type(router).__name__} of this vLLM's FusedMoE has no capture hook")
        return
    vc = _compat.current_vllm_config()
    bad = _record_problems(layer, vc)
    for p in bad:
        rt.violation(p)
    if bad:
        return
    if not _RECORD:
        budget = int(vc.scheduler_config.max_num_batched_tokens)
        sizes = list(getattr(vc.compilation_config, "cudagraph_capture_sizes", None) or [])
        hf = vc.model_config.hf_text_config
        _RECORD.append(RoutingRecord(max([budget, *sizes]), int(hf.num_hidden_layers), int(layer.top_k),
                                     layer.w13_weight.device))
        _wrap_execute_model()
    rec = _RECORD[0]

    def fn(ids: torch.Tensor, _layer: int = index) -> None:
        rec.capture(_layer, ids)

    router.set_capture_fn(fn)  # what vLLM's router calls from select_experts (a modular method)
    if hasattr(layer, "routing_sink") and method.is_monolithic:  # 0.33: a monolithic method reports through a sink
        if not r_ffn():
            experts = getattr(getattr(getattr(method, "moe_kernel", None), "impl", None), "fused_experts", None)
            if not getattr(experts, "supports_routing_replay_capture", lambda: False)():
                rt.violation(f"RL_KERNEL_VLLM_MOE_ROUTING: vLLM's monolithic MoE kernel {type(experts).__name__} "
                             "does not report its expert ids (no routing replay)")
                return
        sink = _compat.module("vllm.model_executor.layers.fused_moe.routed_experts_capturer").RoutedExpertsSink
        layer.routing_sink = sink(layer.moe_config, fn)


def r_ffn() -> bool:
    """Whether the plan runs the ffn module on rlk (R)."""
    return _runtime.get().r("ffn")


def _wrap_execute_model() -> None:
    runner = _compat.module(MRV2_RUNNER).GPUModelRunner
    original = runner.execute_model
    if getattr(original, "_rlk_original", None) is not None:
        return

    def execute_model(self, scheduler_output, *args, **kwargs):
        out = original(self, scheduler_output, *args, **kwargs)
        state = getattr(self, "execute_model_state", None)
        if not kwargs.get("dummy_run", False) and state is not None and _RECORD:
            _RECORD[0].harvest(state.input_batch)
        return out

    execute_model._rlk_original = original
    runner.execute_model = execute_model
    _runtime.get().recorder.add_hook("moe_routing", f"{MRV2_RUNNER}:GPUModelRunner.execute_model", "class-attribute")


def unbind_routing() -> None:
    """Undo :func:`_bind_record`'s ``execute_model`` wrapper and forget the record (tests)."""
    runner = _compat.module(MRV2_RUNNER).GPUModelRunner
    original = getattr(runner.execute_model, "_rlk_original", None)
    if original is not None:
        runner.execute_model = original
    _RECORD.clear()


def method_class() -> type:
    """The out-of-tree ``UnquantizedFusedMoEMethod`` against the installed vLLM's class."""
    base = _compat.module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
                          ).UnquantizedFusedMoEMethod

    r = r_ffn

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
                base.process_weights_after_loading(self, layer)
            else:  # the weights as loaded: the base's step before vLLM's (its own first call), no packing, no kernel
                super(base, self).process_weights_after_loading(layer)
            if envs.current("RL_KERNEL_VLLM_MOE_ROUTING"):  # after: under P on 0.33 the kernel it reads is built
                _bind_record(layer, self)

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
