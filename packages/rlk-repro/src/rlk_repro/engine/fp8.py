"""FP8 rollout on the frameworks engine (issue 38, ladder rungs ``1-fp8`` and ``4-fp8-filters``): vLLM's own FP8
weight + activation quantization serves the rollout, the trainer stays BF16.

``LLM(quantization="fp8")`` with a BF16 checkpoint quantizes every linear layer online (vLLM 0.22's
``Fp8OnlineLinearMethod``): once a layer's weight is loaded, ``process_weights_after_loading`` replaces its BF16
``weight`` ``[out, in]`` by ``ops.scaled_fp8_quant(weight)`` — float8_e4m3fn and one float32 scale per tensor,
``absmax / 448`` — and keeps it transposed: ``weight`` is the ``[in, out]`` view of the ``[out, in]`` FP8 tensor,
``weight_scale`` has shape ``[1]``. Activations are quantized at every call (dynamic scales: per token on Hopper's
CUTLASS kernel, per tensor where CUTLASS is absent; :func:`describe` records which). The embedding and the LM
head stay BF16 (they are not linear layers to vLLM's FP8 config), so are the norms.

The weight sync after a GRPO step cannot hand BF16 tensors to those parameters (they hold FP8 in the kernel's
layout). :func:`load_into_fp8_model` routes the trainer's tensors through vLLM's own weight loaders into BF16
staging parameters of each layer's logical shape (this rank's shard; q/k/v and gate/up fused as vLLM fuses them),
re-quantizes each with :func:`quantize_per_tensor` (the arithmetic of vLLM's dynamic per-tensor kernel) and copies
the bytes into the running parameters in place, so captured CUDA graphs keep their addresses. On CUDA every
layer's result is compared with vLLM's own ``ops.scaled_fp8_quant`` of the same tensor (the call its loader makes);
a difference stops the run. An FP8 rollout is a mismatch knob, never a bitwise claim: the rollout side must be
production code (P) in every module (rlk's R GEMMs are BF16 and vLLM's FP8 methods replace them; the FP8 model
runs on vLLM's V1 runner, where logp R has no hook).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

QUANTIZATIONS = ("none", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: the vLLM linear methods whose weights this module re-quantizes (per-tensor scale, dynamic activations)
FP8_METHODS = ("Fp8OnlineLinearMethod",)
#: vLLM FP8 methods that hold no weight of the trainer's (the attention layers' KV-cache scales; KV stays BF16)
FP8_NO_WEIGHTS = ("Fp8KVCacheMethod",)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``w`` (2-D, any float dtype) as float8_e4m3fn with one float32 scale, the arithmetic of
    vLLM's dynamic per-tensor FP8 quantization (``ops.scaled_fp8_quant(w)``, csrc ``dynamic_scaled_fp8_quant``):
    ``scale = f32(max |w|) / 448`` (one IEEE division), ``q = fp8(clamp(f32(w) * (1 / scale), -448, 448))`` with the
    reciprocal taken once in float32 and round-to-nearest-even into e4m3. ``scale`` has shape ``[1]``. Depends on
    ``w``'s values only (a maximum is order-free; every other step is elementwise). A tensor whose largest magnitude
    is 0 or not finite has no scale and is refused (vLLM's kernel would write 448 or NaN everywhere)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_per_tensor takes a 2-D float tensor, got {tuple(w.shape)} {w.dtype}")
    x = w.to(torch.float32)
    absmax = x.abs().amax()
    if not bool(torch.isfinite(absmax)) or float(absmax) == 0.0:
        raise ValueError(f"quantize_per_tensor: max |w| is {float(absmax)}; an FP8 per-tensor scale needs a finite, "
                         "non-zero maximum")
    # a divisor on the device, not a Python number: torch's CUDA `tensor / scalar` multiplies by the scalar's
    # reciprocal (1 ulp off the IEEE quotient: 0.75 / 448 gave 0x3ADB6DB8 where vLLM's kernel gives 0x3ADB6DB7)
    scale = torch.div(absmax, torch.full_like(absmax, FP8_MAX))
    inv = torch.reciprocal(scale)
    q = (x * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1)


def fp8_linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers of a vLLM model served by one of :data:`FP8_METHODS`, in module order."""
    return [(n, m) for n, m in model.named_modules()
            if type(getattr(m, "quant_method", None)).__name__ in FP8_METHODS]


def _check_layout(name: str, layer: torch.nn.Module) -> None:
    """The kernel layout vLLM's online FP8 method leaves (CUTLASS without padding, or the torch kernels): anything
    else is refused rather than written wrongly."""
    w, s = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
    shape = (layer.input_size_per_partition, layer.output_size_per_partition)
    if not isinstance(w, torch.Tensor) or w.dtype != FP8_DTYPE or tuple(w.shape) != shape \
            or not w.t().is_contiguous():
        got = f"{tuple(w.shape)} {w.dtype} strides {w.stride()}" if isinstance(w, torch.Tensor) else repr(w)
        raise RuntimeError(f"FP8 weight sync: {name}.weight is {got}, not the [in, out] = {list(shape)} transposed "
                           "float8_e4m3fn view vLLM's Fp8OnlineLinearMethod leaves (a padded or repacked kernel "
                           "layout is not covered)")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
        raise RuntimeError(f"FP8 weight sync: {name}.weight_scale is not one float32 per-tensor scale")
    if getattr(layer, "input_scale", None) is not None:
        raise RuntimeError(f"FP8 weight sync: {name} has a static input scale; only dynamic activations are covered")


def _original_loader(param: torch.Tensor) -> Callable:
    """The layer's own weight loader: vLLM wraps it for online processing (``online_process_loader``), which would
    buffer the weights and run the first-load processing again."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        raise RuntimeError("FP8 weight sync: an FP8 weight has no weight_loader to route the BF16 tensor through")
    while getattr(loader, "__name__", None) == "online_process_loader":  # only vLLM's wrappers, never a bound method's
        loader = loader.__wrapped__
    return loader


def vllm_quantizer() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """vLLM's own per-tensor quantization (``ops.scaled_fp8_quant(w, scale=None)``, the call its FP8 loader makes),
    or None where its CUDA kernels are not loaded (CPU)."""
    try:
        from vllm import _custom_ops as ops

        if not hasattr(torch.ops._C, "dynamic_scaled_fp8_quant"):
            return None
    except Exception:
        return None
    return lambda w: ops.scaled_fp8_quant(w, scale=None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def load_into_fp8_model(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                        reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
                        ) -> dict[str, Any]:
    """``model.load_weights(weights)`` into a vLLM model with online-FP8 linear layers, in place: each FP8 layer
    receives its BF16 tensor in a staging parameter through its own loader, is re-quantized
    (:func:`quantize_per_tensor`) and its ``weight`` / ``weight_scale`` bytes overwritten; every other parameter is
    loaded as vLLM loads it. ``reference`` (default :func:`vllm_quantizer`): vLLM's quantization, compared bit for
    bit with this one for every layer (a difference raises). Every parameter must be loaded (the scales are derived).
    Returns ``parameters``, ``loaded``, ``requantized`` (FP8 layers), ``changed`` (parameters whose bytes changed),
    ``checked_against_vllm`` (layers compared with ``reference``)."""
    from vllm.model_executor.parameter import ModelWeightParameter

    from rlk_vllm_plugin.weight_sync import _fingerprint, derived_copies

    stale = derived_copies(model)
    if stale:
        raise RuntimeError(f"FP8 weight sync: layers {stale[:4]} compute from a copy made at load time")
    layers = fp8_linear_layers(model)
    if not layers:
        raise RuntimeError("FP8 weight sync: the model has no FP8 linear layer (was vLLM started with "
                           "quantization='fp8'?)")
    other = sorted({n for n in (type(getattr(m, "quant_method", None)).__name__ for m in model.modules())
                    if "Fp8" in n and n not in (*FP8_METHODS, *FP8_NO_WEIGHTS)})
    if other:
        raise RuntimeError(f"FP8 weight sync: the model has layers served by {', '.join(other)} (e.g. FP8 MoE "
                           "experts), whose re-quantization is not covered; stopped rather than leave them stale")
    reference = vllm_quantizer() if reference is None else reference
    kernel: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    with torch.inference_mode():
        for name, layer in layers:
            _check_layout(name, layer)
            kernel[name] = (layer.weight, layer.weight_scale)
        params = dict(model.named_parameters())
        before = {n: _fingerprint(p) for n, p in params.items()}
        staged: dict[str, torch.nn.Parameter] = {}
        try:
            for name, layer in layers:
                w = kernel[name][0]
                stage = ModelWeightParameter(
                    data=torch.empty(layer.output_size_per_partition, layer.input_size_per_partition,
                                     dtype=layer.orig_dtype, device=w.device),
                    input_dim=1, output_dim=0, weight_loader=_original_loader(w))
                layer._parameters["weight"] = stage
                staged[name] = stage
            loaded = set(model.load_weights(iter(weights)) or ())
            derived = {f"{name}.weight_scale" for name, _ in layers}
            missing = sorted(set(params) - loaded - derived)
            if missing:
                raise RuntimeError(f"FP8 weight sync: {len(missing)} vLLM parameters received no weight: "
                                   f"{missing[:6]}")
            checked, new = 0, {}
            for name, _ in layers:  # every layer checked before any is written: all are updated, or none
                q, scale = quantize_per_tensor(staged[name].data)
                if reference is not None:
                    rq, rs = reference(staged[name].data)
                    if not (_same(q, rq) and _same(scale, rs.reshape(1).to(torch.float32))):
                        raise RuntimeError(f"FP8 weight sync: {name}: rlk's re-quantization differs from vLLM's "
                                           "ops.scaled_fp8_quant of the same BF16 tensor; stopped")
                    checked += 1
                new[name] = (q, scale)
                staged[name].data = torch.empty(0, dtype=staged[name].dtype, device=q.device)  # its memory back
            for name, (q, scale) in new.items():
                kw, ks = kernel[name]
                kw.data.copy_(q.t())
                ks.data.copy_(scale.reshape(ks.shape))
        finally:
            for name, layer in layers:
                layer._parameters["weight"] = kernel[name][0]
        after = {n: _fingerprint(p) for n, p in params.items()}
    return {"parameters": len(params), "loaded": len(loaded & set(params)) + len(derived),
            "requantized": len(layers), "changed": sum(before[n] != after[n] for n in params),
            "checked_against_vllm": checked, "unknown": sorted(loaded - set(params))[:6]}


def load_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """:func:`rlk_vllm_plugin.weight_sync.load_weights` for an FP8 engine: :func:`load_into_fp8_model` in every
    worker, then the prefix cache reset (its KV was computed with the old weights)."""
    from rlk_vllm_plugin import weight_sync

    return weight_sync.load_weights(llm, weights, loader=load_into_fp8_model)


def describe(model: torch.nn.Module) -> dict[str, Any]:
    """What serves the FP8 rollout, read from the model: the FP8 layers, their method, vLLM's scaled-mm kernel and
    its activation quantization, and what stayed BF16."""
    layers = fp8_linear_layers(model)
    kernels = sorted({type(getattr(m.quant_method, "fp8_linear", None)).__name__ for _, m in layers})
    acts = sorted({str(getattr(m.quant_method, "activation_quant_key", None)) for _, m in layers})
    other = sorted({type(m.quant_method).__name__ for _, m in model.named_modules()
                    if getattr(m, "quant_method", None) is not None
                    and type(m.quant_method).__name__ not in FP8_METHODS})
    return {"fp8_linear_layers": len(layers), "methods": sorted({type(m.quant_method).__name__ for _, m in layers}),
            "scaled_mm_kernels": kernels, "activation_quantization": acts,
            "weight_quantization": "float8_e4m3fn, one float32 scale per tensor (absmax / 448)",
            "other_quant_methods": other}


def config_problem(quantization: str, rollout_cases: dict[str, str], cuda_graph_decode: bool = False) -> str | None:
    """Why a run configuration cannot use this rollout quantization, or None. ``rollout_cases``: module ->
    the rollout side's case (``P`` or ``R``); ``cuda_graph_decode``: ``--cuda-graph-decode`` asked for."""
    if quantization not in QUANTIZATIONS:
        return f"--rollout-quantization {quantization!r}: one of {', '.join(QUANTIZATIONS)}"
    if quantization == "none":
        return None
    if cuda_graph_decode:
        return ("--rollout-quantization fp8 with --cuda-graph-decode: vLLM runs a quantized model on its V1 runner, "
                "and the CUDA-graph evidence is Model Runner V2's (rlk_vllm_plugin.cudagraphs)")
    r = sorted(m for m, c in rollout_cases.items() if c == "R")
    if r:
        return (f"--rollout-quantization fp8 with the rollout side R in {', '.join(r)}: vLLM's FP8 linear methods "
                "replace the GEMMs rlk's R routes run (and the FP8 model runs on vLLM's V1 runner, where logp R has no "
                "hook); an FP8 rollout is production code, X/P in every module")
    return None


def device_problem() -> str | None:
    """Why this machine cannot run vLLM's FP8 W8A8 rollout (FP8 tensor cores: sm_89+), or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (vLLM's FP8 W8A8 GEMMs need FP8 tensor cores, sm_89+)"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (8, 9):
        return (f"this GPU ({torch.cuda.get_device_name(0)}, sm_{major}{minor}) has no FP8 tensor cores (sm_89+); "
                "vLLM would fall back to weight-only FP8 Marlin, which is not the W8A8 rollout this rung measures")
    return None
