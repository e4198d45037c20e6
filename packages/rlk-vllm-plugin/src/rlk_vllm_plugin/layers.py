"""Norms, activation, RoPE, linear layers and the LM head: vLLM's layers handed to the route layer.

- ``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` are replaced out of tree (``CustomOp.register_oot``
  by vLLM's class name): subclasses whose ``forward_native`` / ``forward_cuda`` / ``forward_cpu`` all run
  one dispatcher (``_bind_forward``), which asks the route layer for the layer's module and runs the rlk op (``R``) or
  vLLM's own method of the same name (``P``; ``forward`` counts one production call per call of the layer).
- Linear layers: the class attribute ``UnquantizedLinearMethod.apply``; the module comes from the
  layer's ``prefix`` (``model.layers.3.mlp.down_proj`` -> ``ffn``). The LM head:
  ``UnquantizedEmbeddingMethod.apply`` (vLLM calls it only to compute logits) -> module ``logp``.
- Norms and activations carry no prefix in vLLM: :func:`bind_model` names each one after the model is
  built (``BaseModelLoader.load_model`` is wrapped to call it). A norm or activation that is still
  unbound when it runs, while the plan has an ``R`` module, is a violation (strict: raise).

No arithmetic lives here: the residual addition a fused norm performs is the plain elementwise
``x + residual`` in the activation dtype, as in the trainer (exact, identical on both sides).
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_vllm_plugin import _compat, _runtime
from rlk_vllm_plugin._runtime import module_of, patch, unpatch

OOT_NAMES = ("RMSNorm", "SiluAndMul", "RotaryEmbedding", "UnquantizedFusedMoEMethod")
_FORWARDS = ("forward_native", "forward_cuda", "forward_cpu", "forward_hip", "forward_xpu")
_CLASSES: dict[str, type] = {}


def _unbound(layer: torch.nn.Module, op: str) -> None:
    rt = _runtime.get()
    if rt.wanted():
        rt.violation(f"vLLM {type(layer).__name__} ran {op} before rlk-vllm-plugin bound it to a module "
                     "(the model was not built through BaseModelLoader.load_model, or the layer's name is "
                     "unknown to rlk_vllm_plugin._runtime.module_of)")


# -- the rlk side of each replaced op -----------------------------------------------------------------
def _rms_norm_r(module: str, layer: Any, x: torch.Tensor, residual: torch.Tensor | None = None):
    if not layer.has_weight or layer.variance_size_override is not None:
        _runtime.get().violation(f"RMSNorm of {module} has has_weight={layer.has_weight}, "
                                 f"var_hidden_size={layer.variance_size_override}: not the rlk rms_norm contract")
    if residual is not None:
        x = x + residual
        residual = x
    out = _runtime.rlk(module, "rms_norm", x, layer.weight.data, layer.variance_epsilon)
    return out if residual is None else (out, residual)


def _swiglu_r(module: str, layer: Any, x: torch.Tensor) -> torch.Tensor:
    return _runtime.rlk(module, "swiglu", x)


def _rope_r(module: str, layer: Any, positions: torch.Tensor, query: torch.Tensor,
            key: torch.Tensor | None = None):
    if not layer.is_neox_style:
        _runtime.get().violation("RotaryEmbedding with is_neox_style=False: rlk rope is the rotate-half layout")
    positions = positions.flatten()
    t, d = positions.shape[0], layer.head_size

    def rotate(x: torch.Tensor) -> torch.Tensor:
        out = _runtime.rlk(module, "rope", x.reshape(t, -1, d), positions, float(layer.base), int(layer.rotary_dim))
        return out.reshape(x.shape)

    return rotate(query), (rotate(key) if key is not None else None)


def oot_classes(probe: _compat.Probe) -> dict[str, type]:
    """The out-of-tree subclasses, built once against the installed vLLM's classes."""
    if _CLASSES:
        return _CLASSES
    bases = {
        "RMSNorm": (_compat.module("vllm.model_executor.layers.layernorm").RMSNorm, "rms_norm",
                    lambda m, *a, **k: _rms_norm_r(m, *a, **k)),
        "SiluAndMul": (_compat.module("vllm.model_executor.layers.activation").SiluAndMul, "swiglu",
                       lambda m, *a, **k: _swiglu_r(m, *a, **k)),
        "RotaryEmbedding": (_compat.module("vllm.model_executor.layers.rotary_embedding").RotaryEmbedding,
                            "rope", lambda m, *a, **k: _rope_r(m, *a, **k)),
    }
    for name, (base, op, fn) in bases.items():
        ns: dict[str, Any] = {m: _bind_forward(m, op, fn) for m in _FORWARDS}
        ns["forward"] = _entry(op, base)
        ns["__module__"] = __name__
        ns["_rlk_op"] = op
        if name == "RotaryEmbedding":
            ns["_rlk_module"] = "attention"
        _CLASSES[name] = type(f"Rlk{name}", (base,), ns)
    from rlk_vllm_plugin import moe  # issue 36: FusedMoE's method (the ffn module's MoE form)

    _CLASSES["UnquantizedFusedMoEMethod"] = moe.method_class()
    return _CLASSES


def _bind_forward(method: str, op: str, fn: Any):
    """``forward_<platform>``: the rlk op for an R module; vLLM's own method otherwise (counted by
    :func:`_entry`, once per call of the layer, however vLLM's methods call each other)."""
    def forward(self, *args, **kwargs):
        module = getattr(self, "_rlk_module", None)
        if module is None:
            _unbound(self, op)
        elif _runtime.get().r(module):
            return fn(module, self, *args, **kwargs)
        return getattr(super(type(self), self), method)(*args, **kwargs)  # a staticmethod in some classes
    forward.__name__ = method
    return forward


def _entry(op: str, base: type):
    """``forward``: vLLM's ``CustomOp.forward`` (its dispatch), counting one production call for a P module.
    ``base`` is the vLLM class replaced (the class's direct base)."""
    backend_id = f"production.vllm.{base.__name__}"

    def forward(self, *args, **kwargs):
        module = getattr(self, "_rlk_module", None)
        if module is not None and not _runtime.get().r(module):
            _runtime.production(module, op, backend_id)
        return base.forward(self, *args, **kwargs)
    return forward


def register_oot(probe: _compat.Probe, names: list[str]) -> list[str]:
    """``CustomOp.register_oot`` for each of ``names`` not yet registered; returns the names registered.

    ``register_oot`` renames the class (``name = "RMSNorm"``); the name is set back to vLLM's own
    (``rms_norm``), so ``custom_ops`` entries such as ``+rms_norm`` select the same ``forward_*`` method
    for the replacement as for vLLM's class (a P module then runs exactly what vLLM would)."""
    custom_op = _compat.module("vllm.model_executor.custom_op")
    done = []
    for name in names:
        cls = oot_classes(probe)[name]
        current = custom_op.op_registry_oot.get(name)
        if current is cls:
            continue
        if current is not None:
            raise RuntimeError(f"vLLM CustomOp {name!r} already has an out-of-tree replacement {current!r} "
                               "(another plugin); rlk cannot install its own")
        base_name = cls.__mro__[1].__dict__.get("name", getattr(cls.__mro__[1], "name", None))
        custom_op.CustomOp.register_oot(_decorated_op_cls=cls, name=name)
        if base_name is not None:
            cls.name = base_name
        done.append(name)
    return done


def unregister_oot() -> None:
    custom_op = _compat.module("vllm.model_executor.custom_op")
    for name, cls in _CLASSES.items():
        if custom_op.op_registry_oot.get(name) is cls:
            del custom_op.op_registry_oot[name]


# -- linear layers and the LM head (class attributes) -------------------------------------------------
def _linear_module(layer: Any) -> str | None:
    """The module of a linear layer: bound at model load (:func:`bind_model`), else from its prefix."""
    module = getattr(layer, "_rlk_linear_module", _UNBOUND)
    return module_of(getattr(layer, "prefix", "") or "") if module is _UNBOUND else module


_UNBOUND = object()


def _routed(layer: Any) -> tuple[str | None, Any]:
    """A linear layer's module (noted once) and the runtime; a layer of no module is a violation where a plan wants
    rlk somewhere."""
    module = _linear_module(layer)
    _runtime.note_linear(module)
    rt = _runtime.get()
    if module is None and rt.wanted():
        rt.violation(f"vLLM linear layer {getattr(layer, 'prefix', '?')!r} belongs to no rlk module")
    return module, rt


def _linear_apply(original):
    def apply(self, layer, x, bias=None):
        module, rt = _routed(layer)
        if rt.r(module):
            weight = layer.weight
            if _empty(weight):
                rt.violation(f"linear {layer.prefix!r}: vLLM replaced the weight (CPU weight packing); rlk "
                             "cannot run it")
                return original(self, layer, x, bias)
            leaves = _tp_leaves(layer, rt)
            if leaves:  # TP-invariant mode: a row-parallel linear under rlk.gemm.tp.v1 (docs/ops/linear_tp.md), at
                # TP 1 the whole tree and the one rounding (the bias added once) in one op
                return _runtime.rlk(module, "linear_tp", x, weight, bias, leaves)
            return _runtime.rlk(module, "linear", x, weight, bias)
        _runtime.production(module, "linear", "production.vllm.UnquantizedLinearMethod.apply")
        return original(self, layer, x, bias)
    apply._rlk_original = original
    return apply


def _tp_leaves(layer: Any, rt: Any) -> int:
    """G for a row-parallel linear when ``RL_KERNEL_TP_INVARIANT`` is set (read with the plan: ``rt.tp_leaves``), else
    0 — one attribute read when the mode is off, nothing that breaks a ``torch.compile`` trace. At TP 1 the layer's
    whole K holds the G leaves. At TP > 1 the rank's fp32 partial must be merged across the TP group before the one
    rounding, which the linear method cannot do: ``rlk_vllm_plugin.row_parallel``'s layer does it in its forward and
    reaches this method only where it refused the layer (reported there; here it runs as rlk.gemm.bi.v1). Any other
    row-parallel layer at TP > 1 — built before ``register()``, or a subclass with its own forward — is refused."""
    leaves = rt.tp_leaves
    if not leaves or not isinstance(layer, _ROW_PARALLEL):  # the class resolved at install: no import in a trace
        return 0
    if getattr(layer, "tp_size", 1) > 1:
        if getattr(type(layer), "_rlk_bind", None) is None:  # not rlk_vllm_plugin.row_parallel's layer
            rt.violation(f"RL_KERNEL_TP_INVARIANT={leaves}: linear {getattr(layer, 'prefix', '?')!r} runs at TP "
                         f"{layer.tp_size} as {type(layer).__name__}, not rlk's row-parallel layer (built before "
                         "rlk-vllm-plugin registered, or a subclass with its own forward): its partial would be "
                         "rounded before vLLM's all-reduce")
        return 0
    return leaves


def _empty(weight: torch.Tensor) -> bool:
    """``weight.numel() == 0``. vLLM's weights are parameter subclasses whose ``__torch_function__`` only
    passes calls through, at ~5 us of host time per call: outside tracing, the query skips it."""
    if torch.compiler.is_compiling():
        return weight.numel() == 0
    with torch._C.DisableTorchFunctionSubclass():
        return weight.numel() == 0


def _lm_head_apply(original):
    def apply(self, layer, x, bias=None):
        rt = _runtime.get()
        if rt.r("logp"):
            weight = layer.weight
            if _empty(weight):
                rt.violation("LM head: vLLM replaced the weight (CPU weight packing); rlk cannot run it")
                return original(self, layer, x, bias)
            return _runtime.rlk("logp", "linear", x, weight, bias)
        _runtime.production("logp", "linear", "production.vllm.UnquantizedEmbeddingMethod.apply")
        return original(self, layer, x, bias)
    apply._rlk_original = original
    return apply


def _quantized_apply(original, name: str):
    """A quantized linear method's ``apply`` (vLLM's ``Fp8LinearMethod`` under ``--rollout-quantization fp8``, or
    any other ``LinearMethodBase`` but the unquantized one): vLLM's own GEMM, counted as
    ``production.vllm.<name>.apply`` in the layer's module — so the readback shows what served an FP8 rollout — and
    refused in an R module, whose contract runs the unquantized weights (no silent production GEMM under R)."""
    def apply(self, layer, x, bias=None):
        module, rt = _routed(layer)
        if rt.r(module):
            rt.violation(f"linear {getattr(layer, 'prefix', '?')!r} runs vLLM's quantized method {name} in module "
                         f"{module!r}, whose route is R: rlk runs unquantized weights only (a quantized rollout is "
                         "P in every module)")
        _runtime.production(module, "linear", f"production.vllm.{name}.apply")
        return original(self, layer, x, bias)
    apply._rlk_original = original
    return apply


_QUANTIZED: list[type] = []  # the quantized linear methods whose apply bind_model wrapped (uninstall puts them back)


def count_quantized(method: Any) -> str | None:
    """Wrap the ``apply`` of a layer's quantized linear method class once (the class in its MRO that defines it);
    the class's name, or None for the unquantized method, a method that is not a linear one, or one done before."""
    linear = _compat.module("vllm.model_executor.layers.linear")
    if not isinstance(method, linear.LinearMethodBase) or isinstance(method, linear.UnquantizedLinearMethod):
        return None
    owner = next(c for c in type(method).__mro__ if "apply" in c.__dict__)
    if not patch(owner, "apply", lambda original: _quantized_apply(original, owner.__name__)):
        return None
    _QUANTIZED.append(owner)
    _runtime.get().add_hook(f"linear_quantized.{owner.__name__}", f"{owner.__module__}.{owner.__name__}.apply",
                            "patch")
    return owner.__name__


_ROW_PARALLEL: tuple[type, ...] = ()  # vLLM's RowParallelLinear, set by install_linear


def install_linear(probe: _compat.Probe) -> None:
    global _ROW_PARALLEL
    linear = _compat.module("vllm.model_executor.layers.linear")
    _ROW_PARALLEL = (linear.RowParallelLinear,)
    patch(linear.UnquantizedLinearMethod, "apply", _linear_apply)


def install_lm_head(probe: _compat.Probe) -> None:
    vpe = _compat.module("vllm.model_executor.layers.vocab_parallel_embedding")
    patch(vpe.UnquantizedEmbeddingMethod, "apply", _lm_head_apply)
    plain_weight_types()


def plain_weight_types() -> list[type]:
    """Tell rlk_core's op layer that vLLM's weight parameters are plain tensors for its direct path
    (:func:`rlk_core.ops.treat_as_plain`): ``BasevLLMParameter.__torch_function__`` only forwards
    to ``Parameter``'s, which is torch's disabled (pass-through) implementation, so an eager rlk call with a
    vLLM weight need not go through the dispatcher (~80 us of host time per LM-head call on the H200).
    Only classes of ``vllm.model_executor.parameter`` that do not override ``__torch_function__`` again are
    registered; on a vLLM where the base's chain is not that, none (they keep the dispatcher path)."""
    from rlk_core.ops import treat_as_plain

    mod = _compat.module("vllm.model_executor.parameter")
    base = getattr(mod, "BasevLLMParameter", None)
    own = None if base is None else base.__dict__.get("__torch_function__")
    if own is None or torch.nn.Parameter.__torch_function__ is not torch._C._disabled_torch_function_impl:
        return []
    types = [cls for cls in vars(mod).values()
             if isinstance(cls, type) and issubclass(cls, base)
             and all(own is k.__dict__.get("__torch_function__", own) for k in cls.__mro__ if issubclass(k, base))]
    treat_as_plain(*types)
    return types


def uninstall() -> None:
    unpatch(_compat.module("vllm.model_executor.layers.linear").UnquantizedLinearMethod, "apply")
    while _QUANTIZED:
        unpatch(_QUANTIZED.pop(), "apply")
    unpatch(_compat.module("vllm.model_executor.layers.vocab_parallel_embedding").UnquantizedEmbeddingMethod,
             "apply")
    base_loader = _compat.module("vllm.model_executor.model_loader.base_loader")
    unpatch(base_loader.BaseModelLoader, "load_model")
    unregister_oot()


# -- binding norms / activations to modules after the model is built ----------------------------------
def bind_model(model: torch.nn.Module) -> dict[str, str]:
    """Name every replaced norm / activation of ``model`` after the module it belongs to (and note each
    linear layer's module from its prefix, once); returns ``{layer name: module}``. A replaced layer whose
    name matches no rule is left unbound (it then fails closed when it runs under a plan with an R module)."""
    out: dict[str, str] = {}
    classes = tuple(_CLASSES.values())
    for name, layer in model.named_modules():
        prefix = getattr(layer, "prefix", None)
        if isinstance(prefix, str) and hasattr(layer, "quant_method"):  # linear layers: no regex per call
            layer._rlk_linear_module = module_of(prefix)
            count_quantized(layer.quant_method)  # issue 38: an FP8 (quantized) linear method is counted, or refused
            bind = getattr(type(layer), "_rlk_bind", None)
            if bind is not None:  # issue 35: rlk_vllm_plugin.row_parallel's layer, decided (refused) at load
                bind(layer)
        if classes and isinstance(layer, classes):
            module = "attention" if layer._rlk_op == "rope" else module_of(name)
            if name.endswith((".q_norm", ".k_norm")):
                module = "attention"
            if module is not None:
                layer._rlk_module = module
                out[name] = module
            if layer._rlk_op == "rope" and _runtime.get().r("attention"):
                _reserve_rope(layer)
    return out


def _reserve_rope(layer: Any) -> None:
    """Build rlk's cos/sin table for every position the model can see, before vLLM captures CUDA graphs (a
    rope call under capture cannot size its table; see rlk_core.ops.rope.reserve_tables)."""
    from rlk_core.ops.rope import reserve_tables

    cache = getattr(layer, "cos_sin_cache", None)
    device = cache.device if isinstance(cache, torch.Tensor) else torch.device("cpu")
    reserve_tables(device, int(layer.rotary_dim), float(layer.base), int(layer.max_position_embeddings))


def _load_model(original):
    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        rt = _runtime.get()
        bind_model(model)
        from rlk_vllm_plugin import attention, collectives
        attention.check_model(model, rt)
        collectives.check_config(rt)
        check_head_dtype(rt)
        rt.flush()
        return model
    load_model._rlk_original = original
    return load_model


def install_loader(probe: _compat.Probe) -> None:
    base_loader = _compat.module("vllm.model_executor.model_loader.base_loader")
    patch(base_loader.BaseModelLoader, "load_model", _load_model)


def check_head_dtype(rt: _runtime.Runtime) -> None:
    """0.33: a ``head_dtype`` other than the model dtype computes the LM head with ``torch.mm`` and
    bypasses ``UnquantizedEmbeddingMethod.apply`` (shared/reference/vllm.md §6.4): refuse it for logp R."""
    cfg = _compat.current_vllm_config()
    model_config = getattr(cfg, "model_config", None)
    head_dtype = getattr(model_config, "head_dtype", None)
    if rt.r("logp") and head_dtype is not None and head_dtype != getattr(model_config, "dtype", head_dtype):
        rt.violation(f"logp R: vLLM head_dtype={head_dtype} bypasses the LM-head hook; drop the head_dtype "
                     "override")
