"""Every vLLM import of the plugin, and what this plugin knows about vLLM versions.

Nothing here imports vLLM at module import time: :func:`api` resolves the hook targets when
``register()`` runs. Versions are told apart by the features they have (``hasattr`` / import probes),
never by the version string alone; the one version check is the coarse gate :data:`SUPPORTED`
(0.22.x, the VIME pin, through 0.33.x), and a vLLM outside it is refused in strict mode.

Known differences handled here (see ``shared/reference/vllm.md`` §10):

- KV-cache contract: 0.22 asks the backend for ``get_kv_cache_shape`` / ``get_kv_cache_stride_order``;
  0.33 has ``KVCacheLayout`` and ``supported_kv_cache_layouts()``. :data:`KV_SHIM` gives both the same
  physical tensor (logical ``[B, H, N, 2D]``, physical ``[B, N, H, 2D]``).
- ``get_supported_kernel_block_sizes``: no argument in 0.22, ``(kv_cache_spec=None)`` in 0.33.
- The batch-invariant module moved from ``layers/`` (0.22) to ``determinism/`` (0.33).
- 0.33's ``prompt_logprob`` module binds ``compute_token_logprobs`` by name; 0.22's does not.
- MRv2 ``Sampler.add_request``: ``(req_idx, prompt_len, sampling_params)`` in 0.22, ``(req_idx,
  sampling_params)`` in 0.33: a wrapper finds an argument by name in the signature (:func:`argument`), and a
  target lacking the parameter (:data:`PARAMETERS`) is a missing target.
- ``SiluAndMul`` on the CPU platform: 0.22 forces the eager ``forward_native``; 0.33 lets ``CustomOp``
  compile it (``maybe_compile``) when the op is disabled under a compiling config. Nothing to shim (the
  out-of-tree class inherits the dispatch), but the readback then shows compiled call sites for it.
- ``UnquantizedFusedMoEMethod.is_monolithic``: 0.22 defines the property on the class (the CPU backend's escape
  hatch); 0.33 inherits ``FusedMoEMethodBase``'s. The plugin's subclass overrides it either way, so the target is
  :data:`INHERITED`: found on the class or a base.
- ``FusedMoE``: 0.22's method is handed the ``FusedMoE`` (router, ``layer_id``); 0.33's the ``RoutedExperts`` (weights
  and a ``routing_sink``), its ``MoERunner`` (router, ``layer_id``) registered by layer name in the compilation
  config's ``static_forward_context``. The routing record finds either (``moe.moe_site`` / ``moe.capture_hook``).
- CPU platform: 0.33 packs bf16 linear weights for its sgl-kernel GEMM on any AMX CPU (0.22 only with
  ``VLLM_CPU_SGL_KERNEL=1``); the weight is then emptied and an R linear layer is a violation (rlk cannot
  run it). Production runs on CUDA, where neither version packs.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

SUPPORTED = ((0, 22), (0, 34))  # [low, high) on (major, minor)
VERIFIED = ("0.22.0", "0.33.0")  # versions the CPU suite ran against (tests/vllm; scripts/test-vllm-033.sh)

# The hook targets, by the module of the route plan that needs them: "module:attribute" (a dotted
# attribute path after the colon). A target missing from the installed vLLM is named in the refusal.
TARGETS: dict[str, tuple[str, ...]] = {
    "common": (
        "vllm.model_executor.custom_op:CustomOp.register_oot",
        "vllm.model_executor.custom_op:op_registry_oot",
        "vllm.model_executor.layers.layernorm:RMSNorm.forward_native",
        "vllm.model_executor.layers.linear:UnquantizedLinearMethod.apply",
        "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
    ),
    "count": (  # the production layers counted for P modules (every plan, all P included)
        "vllm.model_executor.layers.activation:SiluAndMul.forward_native",
        "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply",
        # issue 36: FusedMoE's method (rlk_vllm_plugin.moe), replaced out of tree for every plan
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.apply_monolithic",
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.is_monolithic",
        # issue 40: the sampler's requests, greedy or sampled (rlk_vllm_plugin.logprobs.note_request), every plan
        "vllm.v1.worker.gpu.sample.sampler:Sampler.add_request",
    ),
    "ffn": (
        "vllm.model_executor.layers.activation:SiluAndMul.forward_native",
    ),
    "attention": (
        "vllm.model_executor.layers.rotary_embedding:RotaryEmbedding.forward_native",
        "vllm.v1.attention.backends.registry:register_backend",
        "vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM",
        "vllm.v1.attention.backend:AttentionBackend",
        "vllm.v1.attention.backend:AttentionImpl",
        "vllm.v1.attention.backend:AttentionMetadataBuilder",
        "vllm.v1.attention.backend:AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE",
        "vllm.v1.attention.backend:CommonAttentionMetadata",
        "vllm.v1.attention.backend:MultipleOf",
    ),
    "logp": (
        "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply",
        "vllm.v1.worker.gpu.sample.logprob:compute_token_logprobs",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.apply_sampling_params",
        "vllm.v1.sample.sampler:Sampler.compute_logprobs",
    ),
    "tp": (
        "vllm.distributed.parallel_state:GroupCoordinator._all_reduce_out_place",
    ),
    "tp_invariant": (  # RL_KERNEL_TP_INVARIANT with attention or ffn R: rlk_vllm_plugin.row_parallel
        "vllm.model_executor.custom_op:PluggableLayer.register_oot",
        "vllm.model_executor.layers.linear:RowParallelLinear.forward",
        "vllm.distributed.parallel_state:get_tp_group",
        "vllm.distributed:split_tensor_along_last_dim",
    ),
}

# Targets the plugin overrides in a subclass rather than wrapping: defined on the named class or inherited from one
# of its bases (vLLM 0.33's UnquantizedFusedMoEMethod inherits is_monolithic from FusedMoEMethodBase).
INHERITED: frozenset[str] = frozenset({
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.is_monolithic",
})

# Parameters (by name) a wrapped target must take: a target whose signature lacks one is named as missing.
PARAMETERS: dict[str, tuple[str, ...]] = {
    "vllm.v1.worker.gpu.sample.sampler:Sampler.add_request": ("sampling_params",),
    "vllm.v1.worker.gpu.sample.sampler:Sampler.apply_sampling_params": ("logits", "expanded_idx_mapping",
                                                                         "idx_mapping_np"),
}


@dataclass
class Probe:
    """What :func:`probe` found: the version, resolved targets and the names it could not find."""

    version: str
    found: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    features: dict[str, bool] = field(default_factory=dict)

    def get(self, target: str) -> Any:
        return self.found[target]


def _resolve(target: str) -> Any:
    mod_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(mod_name)
    parts = attr.split(".")
    for n, part in enumerate(parts):
        inherited = target in INHERITED and n == len(parts) - 1
        if isinstance(obj, type) and inherited:
            # a subclass overrides it: the class or any base may define it (looked up without calling a property)
            owner = next((c for c in obj.__mro__ if part in vars(c)), None)
            if owner is None:
                raise AttributeError(f"neither {obj.__qualname__} nor its bases define {part!r}")
            obj = vars(owner)[part]
            continue
        if isinstance(obj, type) and part not in vars(obj):
            # a class must define the hooked attribute itself: one inherited from a base is not the target
            raise AttributeError(f"{obj.__qualname__} does not define {part!r} itself")
        obj = getattr(obj, part)
    return obj


def module(name: str) -> ModuleType:
    """``import vllm.<...>``: the one place the plugin imports a vLLM module by name."""
    if not name.startswith("vllm"):
        raise ValueError(f"not a vLLM module: {name!r}")
    return importlib.import_module(name)


def version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def in_range(version: str) -> bool:
    low, high = SUPPORTED
    return low <= version_tuple(version) < high


def probe(groups: tuple[str, ...]) -> Probe:
    """Import vLLM and resolve the targets of ``groups``; never raises for a missing target."""
    vllm = importlib.import_module("vllm")
    p = Probe(version=str(getattr(vllm, "__version__", "unknown")))
    for group in groups:
        for target in TARGETS[group]:
            try:
                p.found[target] = _resolve(target)
            except (ImportError, AttributeError) as exc:
                p.missing.append(f"{target} ({type(exc).__name__}: {exc})")
                continue
            # an already installed wrapper takes (*args, **kwargs): the signature is its original's
            called = getattr(p.found[target], "_rlk_original", p.found[target])
            lacking = [n for n in PARAMETERS.get(target, ()) if n not in parameters(called)]
            if lacking:
                del p.found[target]
                p.missing.append(f"{target} (signature: no parameter {', '.join(map(repr, lacking))})")
    p.features = {
        "kv_cache_layout": _importable("vllm.v1.kv_cache_layout"),
        "prompt_logprob_binding": _has("vllm.v1.worker.gpu.sample.prompt_logprob", "compute_token_logprobs"),
        "bi_module_determinism": _importable("vllm.model_executor.determinism.batch_invariant"),
    }
    return p


def parameters(fn: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def argument(fn: Any, name: str) -> Callable[[tuple, dict], Any]:
    """``get(args, kwargs)``: the value of ``fn``'s parameter ``name`` in a call ``fn(*args, **kwargs)`` (``args``
    including ``self`` for a method), located by name in ``fn``'s signature once."""
    index = parameters(fn).index(name)

    def get(args: tuple, kwargs: dict) -> Any:
        return kwargs[name] if name in kwargs else args[index]
    return get


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _has(name: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(name), attr)
    except ImportError:
        return False


def batch_invariant_module() -> ModuleType:
    """vLLM's batch-invariant module (0.33: ``determinism/``, 0.22: ``layers/``)."""
    for name in ("vllm.model_executor.determinism.batch_invariant", "vllm.model_executor.layers.batch_invariant"):
        if _importable(name):
            return importlib.import_module(name)
    raise ImportError("vLLM has no batch_invariant module under determinism/ (0.33) or layers/ (0.22)")


def kv_cache_layout_lbnhc() -> Any:
    """``KVCacheLayout.LBNHC`` (0.33), or None where vLLM has no ``KVCacheLayout`` (0.22)."""
    if not _importable("vllm.v1.kv_cache_layout"):
        return None
    return importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout.LBNHC


def current_vllm_config() -> Any:
    """The vLLM config being built or run, or None (``get_current_vllm_config_or_none``, both versions)."""
    from vllm.config import get_current_vllm_config_or_none
    return get_current_vllm_config_or_none()


# -- the KV layout shim (shared/reference/vllm.md §5.3) --------------------------------------------------
def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """0.22's logical per-layer KV shape that equals 0.33's default: ``[B, H, N, 2D]``."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


KV_STRIDE_ORDER = (0, 2, 1, 3)  # physical [B, N, H, 2D] (0.33's LBNHC)


def split_kv(kv_cache: Any, head_size: int) -> tuple[Any, Any]:
    """``(k_cache, v_cache)``, each a strided ``[num_blocks, block_size, Hkv, D]`` view (both versions)."""
    k_cache, v_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k_cache, v_cache
