"""In-place weight update of a running ``vllm.LLM`` from a trainer (no restart, no checkpoint on disk).

:func:`load_weights` hands ``(Hugging Face name, full tensor)`` pairs to the model's own ``load_weights``
inside the worker (``LLM.apply_model``, public API: the function runs in the worker process; with the engine
core in-process — ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uni-process or ``external_launcher`` executor —
that is this process and the tensors are passed by reference). vLLM's weight loaders copy into the existing
parameters (``param.data.copy_`` of this rank's shard), so every address a captured CUDA graph or a compiled
graph holds stays valid. Then the prefix cache is reset: cached KV blocks were computed with the old
weights.

What the plugin keeps from load time, and why an in-place copy is enough (checked, vLLM 0.22 on CUDA):
rlk's linear / LM-head methods and RMSNorm read ``layer.weight`` on every call, the attention backend holds
no weights, RoPE's cos/sin tables depend on (base, dims, positions) only; vLLM's
``UnquantizedLinearMethod`` / ``UnquantizedEmbeddingMethod.process_weights_after_loading`` do nothing on
CUDA. Only vLLM's CPU platform derives a packed copy (``layer.cpu_linear`` with an emptied ``weight``);
:func:`derived_copies` finds such layers and :func:`load_weights` refuses to update a model holding them.

A ``FusedMoE`` layer (Qwen3-MoE, issue 36) holds all its experts in two parameters, ``w13_weight [E, 2I, H]`` (each
expert's ``gate_proj`` rows, then ``up_proj``) and ``w2_weight [E, H, I]``, which vLLM's loader fills one Hugging Face
tensor (``mlp.experts.<e>.{gate,up,down}_proj.weight``) at a time; a parameter counts as loaded once one expert reached
it, so :func:`load_into_model` also checks that every expert of every such layer received its three tensors. vLLM's
unquantized method keeps that layout on CUDA with its Triton kernels (FlashInfer's reorders it at load time: the
frameworks engine keeps it off, ``VLLM_USE_FLASHINFER_MOE_FP16=0``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def derived_copies(model: torch.nn.Module) -> list[str]:
    """Layers whose computation does not read their ``weight`` parameter (a copy derived at load time that an
    in-place update would leave stale)."""
    out = []
    for name, layer in model.named_modules():
        w = getattr(layer, "weight", None)
        if callable(getattr(layer, "cpu_linear", None)) and isinstance(w, torch.Tensor) and w.numel() == 0:
            out.append(name)
    return out


def _fingerprint(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """A position-weighted byte sum (in chunks: bounded temporary memory); tells changed bytes apart."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    total = torch.zeros((), device=b.device, dtype=torch.int64)
    for start in range(0, b.numel(), chunk):
        part = b[start : start + chunk].to(torch.int64)
        pos = (torch.arange(start, start + part.numel(), device=b.device, dtype=torch.int64) % 65521) + 1
        total += (part * pos).sum()
    return int(total)


def expert_layers(model: torch.nn.Module) -> dict[str, int]:
    """The model's ``FusedMoE``-like layers (a ``w13_weight`` and a ``w2_weight``): module name -> experts held."""
    return {name: int(m.w13_weight.shape[0]) for name, m in model.named_modules()
            if isinstance(getattr(m, "w13_weight", None), torch.Tensor) and hasattr(m, "w2_weight")}


def _missing_experts(layers: dict[str, int], names: set[str]) -> list[str]:
    """The ``<layer>.<e>.<proj>`` Hugging Face tensors no weight was given for (expert parallelism aside: EP 1)."""
    out = []
    for layer, n in layers.items():
        for e in range(n):
            out += [f"{layer}.{e}.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")
                    if f"{layer}.{e}.{proj}.weight" not in names]
    return out


def load_into_model(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``model.load_weights(weights)`` in place, checked: every parameter of ``model`` must be loaded
    (``missing`` otherwise raises), every expert of a ``FusedMoE`` layer too, and the parameters whose bytes
    changed are counted."""
    stale = derived_copies(model)
    if stale:
        raise RuntimeError(f"rlk weight_sync: layers {stale[:4]} compute from a copy made at load time "
                           "(vLLM's CPU weight packing); an in-place update would leave it stale")
    params = dict(model.named_parameters())
    layers = expert_layers(model)
    given: set[str] = set()

    def seen(pairs):
        for name, t in pairs:
            given.add(name)
            yield name, t

    with torch.inference_mode():  # also allowed if vLLM created its parameters as inference tensors
        before = {n: _fingerprint(p) for n, p in params.items()}
        loaded = model.load_weights(seen(iter(weights)))
        after = {n: _fingerprint(p) for n, p in params.items()}
    loaded = set(loaded or ())
    missing = sorted(set(params) - loaded)
    if missing:
        raise RuntimeError(f"rlk weight_sync: {len(missing)} vLLM parameters received no weight: {missing[:6]}")
    experts = _missing_experts(layers, given)
    if experts:
        raise RuntimeError(f"rlk weight_sync: {len(experts)} expert weights of FusedMoE layers received no weight: "
                           f"{experts[:6]}")
    unknown = sorted(loaded - set(params))
    return {"parameters": len(params), "loaded": len(loaded & set(params)), "unknown": unknown[:6],
            "changed": sum(before[n] != after[n] for n in params)}


def load_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]], loader: Any = None) -> dict[str, Any]:
    """Update a running ``vllm.LLM`` in place from ``(HF name, full tensor)`` pairs (every TP rank of vLLM
    receives the full tensors and its weight loaders take their shard), then reset its prefix cache.
    ``loader(model, weights)`` runs in every worker (default :func:`load_into_model`; the FP8 rollout passes its
    re-quantizing one). Returns the per-worker results (the first worker's, plus ``workers``)."""
    load = loader or load_into_model
    results = llm.apply_model(lambda model: load(model, weights))
    if not llm.reset_prefix_cache():
        raise RuntimeError("rlk weight_sync: vLLM refused to reset its prefix cache (requests still running?); "
                           "KV computed with the old weights could be reused")
    out = dict(results[0])
    out["workers"] = len(results)
    return out


__all__ = ["derived_copies", "expert_layers", "load_into_model", "load_weights"]
