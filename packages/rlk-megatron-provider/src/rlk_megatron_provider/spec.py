"""The layer spec: the user's (or Megatron's stock) spec with the slots of every R module replaced.

Integration by construction: :func:`rlk_layer_spec` takes a stock ``TransformerLayer`` spec (local or TE)
and returns a copy in which the modules whose train letter is ``R`` are rlk classes; every slot of a
``P`` module is the stock spec's own object, untouched (the fallback provider). :func:`rlk_block_spec`
adds the final norm (module ``logp``). :func:`prepare_model` finishes a built ``GPTModel``: the LM head of
an R ``logp`` (the one patch, :mod:`rlk_megatron_provider.patches`), production-call recording for P
modules, and :func:`verify_model`, which checks that what was built is what the plan asks for.

Which slot belongs to which module (``rlk_core.routes.MODULE_SCOPE``): attention = ``input_layernorm``,
``self_attention`` (QKV/proj linears, q/k norms, RoPE, core attention); ffn = ``pre_mlp_layernorm``,
``mlp``; logp = the block's final norm and ``output_layer``.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F

from rlk_core import envs
from rlk_megatron_provider import _compat, _state, patches
from rlk_megatron_provider.attention import RlkCoreAttention, RlkSelfAttention, config_problems
from rlk_megatron_provider.layers import (
    RlkColumnParallelLinear,
    RlkMLP,
    RlkQKVLinear,
    RlkRMSNorm,
    RlkRowParallelLinear,
    _RlkLayer,
)

ModuleSpec = _compat.ModuleSpec


def model_problems(config, hybrid: bool = False) -> dict[str, list[str]]:
    """Config-level reasons each module's R route cannot be installed (TE-only or uncovered features); ``hybrid``:
    for a HybridModel stack (whose MoE layers the MoE layer spec does not cover)."""
    common = []
    if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
        common.append(f"normalization={config.normalization!r} (rlk covers RMSNorm)")
    if getattr(config, "layernorm_zero_centered_gamma", False):
        common.append("layernorm_zero_centered_gamma is not covered")
    if getattr(config, "add_bias_linear", False):
        common.append("add_bias_linear=True (rlk linears cover bias-free layers)")
    if getattr(config, "sequence_parallel", False) and not envs.current("RL_KERNEL_TP_INVARIANT"):
        common.append("sequence_parallel=True is covered in TP-invariant mode only (set RL_KERNEL_TP_INVARIANT)")
    if getattr(config, "fp8", None):
        common.append(f"fp8={config.fp8!r} is requested (a TE feature)")
    if getattr(config, "tp_comm_overlap", False):
        common.append("tp_comm_overlap (TE userbuffers) is requested")
    ffn = list(common)
    if getattr(config, "num_moe_experts", None) and hybrid:
        ffn.append("MoE layers are not covered in a HybridModel (the MoE layer spec covers GPTModel's)")
    elif getattr(config, "num_moe_experts", None):  # issue 36: the MoE layer spec (rlk_megatron_provider.moe)
        from rlk_megatron_provider.moe import moe_problems

        ffn += moe_problems(config)
    if not (getattr(config, "gated_linear_unit", False) and getattr(config, "activation_func", None) is F.silu):
        ffn.append("the MLP activation is not SwiGLU (gated_linear_unit with F.silu)")
    return {"attention": common + config_problems(config), "ffn": ffn, "logp": list(common)}


def _norm(module: str) -> ModuleSpec:
    return ModuleSpec(module=RlkRMSNorm, params={"rlk_module": module})


def _linear(cls: type, module: str) -> ModuleSpec:
    return ModuleSpec(module=cls, params={"rlk_module": module})


def _active(config, hybrid: bool = False) -> dict[str, bool]:
    """Which modules get rlk slots: R in the plan and installable (a refusal raises in strict mode)."""
    st = _state.get()
    problems = model_problems(config, hybrid)
    out = {}
    for m in ("attention", "ffn", "logp"):
        ok = st.rlk(m)
        if ok and problems[m]:
            ok = st.refuse(m, "; ".join(problems[m]))
        out[m] = ok
    return out


def rlk_layer_spec(config, *, rope_theta: float, base: ModuleSpec | None = None) -> ModuleSpec:
    """A ``TransformerLayer`` spec with rlk in the slots of the plan's R modules.

    ``base``: the stock spec to start from (default: Megatron's local spec with qk-layernorm and
    RMSNorm, the Qwen3 shape); its P slots are kept as they are. ``rope_theta``: the model's
    ``rotary_base`` (RoPE moves into the rlk core attention for an R attention)."""
    if base is None:
        base = _compat.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return _layer_spec(config, rope_theta, base, ("attention", "ffn"), _active(config))


def _layer_spec(config, rope_theta: float, base, slots: tuple[str, ...], active: dict[str, bool],
                where: str = "") -> ModuleSpec:
    """``base`` (a ``TransformerLayer`` spec) with rlk in the slots of the ``slots`` modules that are
    ``active`` (the others untouched). ``where``: named in refusals (e.g. the HybridStack slot)."""
    st = _state.get()
    active = {m: active[m] and m in slots for m in ("attention", "ffn")}
    if not (isinstance(base, ModuleSpec) and isinstance(base.module, type)
            and issubclass(base.module, _compat.TransformerLayer)
            and isinstance(base.submodules, _compat.TransformerLayerSubmodules)):
        for m in slots:
            if active[m]:
                active[m] = st.refuse(m, f"the base {where}layer spec is not a TransformerLayer spec: {base!r}")
    if not (active["attention"] or active["ffn"]):
        return base
    sub = base.submodules
    changes = {}
    if active["attention"]:
        attn = sub.self_attention
        ok = isinstance(attn, ModuleSpec) and isinstance(attn.submodules, _compat.SelfAttentionSubmodules)
        if not ok:
            st.refuse("attention", f"{where}self_attention slot {attn!r} is not a SelfAttention spec")
        else:
            a = attn.submodules
            has_q, has_k = (_has(x) for x in (a.q_layernorm, a.k_layernorm))
            if getattr(config, "qk_layernorm", False) and not (has_q and has_k):
                # Megatron would build this attention without q/k norms although the config asks for them
                # (the stock 0.19 hybrid_stack_spec has no q/k norm slots): not the model the config describes
                st.refuse("attention", f"config.qk_layernorm=True but the base {where}self_attention spec has no "
                                       "q_layernorm/k_layernorm slots (Megatron would run it without q/k norms)")
        if ok and st.rlk("attention"):
            changes["input_layernorm"] = _norm("attention")
            changes["self_attention"] = ModuleSpec(
                module=RlkSelfAttention, params=dict(attn.params),
                submodules=_compat.SelfAttentionSubmodules(
                    linear_qkv=_linear(RlkQKVLinear, "attention"),
                    core_attention=ModuleSpec(module=RlkCoreAttention, params={"rope_theta": float(rope_theta)}),
                    linear_proj=_linear(RlkRowParallelLinear, "attention"),
                    q_layernorm=_norm("attention") if has_q else None,
                    k_layernorm=_norm("attention") if has_k else None,
                ))
    if active["ffn"]:
        cls, _ = _compat.mlp_parts(sub.mlp)
        if isinstance(cls, type) and issubclass(cls, _compat.moe().MoELayer):
            from rlk_megatron_provider.moe import moe_spec

            changes["pre_mlp_layernorm"] = _norm("ffn")
            changes["mlp"] = moe_spec(sub.mlp)
        elif not (isinstance(cls, type) and issubclass(cls, _compat.MLP)):
            st.refuse("ffn", f"the {where}MLP slot {sub.mlp!r} is not a dense Megatron MLP")
        else:
            changes["pre_mlp_layernorm"] = _norm("ffn")
            changes["mlp"] = _compat.mlp_slot(RlkMLP, _compat.MLPSubmodules(
                linear_fc1=_linear(RlkColumnParallelLinear, "ffn"), linear_fc2=_linear(RlkRowParallelLinear, "ffn")))
    if not changes:
        return base
    return ModuleSpec(module=base.module, params=dict(base.params),
                      submodules=dataclasses.replace(sub, **changes))


def _has(slot) -> bool:
    return slot is not None and not (isinstance(slot, type) and issubclass(slot, _compat.IdentityOp))


def rlk_block_spec(config, *, rope_theta: float, base: ModuleSpec | None = None, vp_stage: int | None = None):
    """``TransformerBlockSubmodules`` for ``GPTModel(transformer_layer_spec=...)``: :func:`rlk_layer_spec`
    for every layer and, for an R ``logp``, the rlk final norm (else Megatron's stock one)."""
    layer = rlk_layer_spec(config, rope_theta=rope_theta, base=base)
    block = _compat.stock_block_submodules(config, layer, vp_stage)
    if _active(config)["logp"]:
        block = dataclasses.replace(block, layer_norm=_norm("logp"))
    return block


# HybridModel (megatron-core 0.19; GPTModel is deprecated there in its favour). A dense Qwen3 block is two
# hybrid layers, pattern "*-": a TransformerLayer with only the attention half (``attention_layer`` slot)
# and an ``MLPLayer`` with only the MLP half (``mlp_layer`` slot). The other layer families (Mamba, GDN,
# DSA, MLA, MoE) are not covered: their slots stay stock and a pattern that uses them is refused for the
# module they belong to (:func:`verify_model`).
HYBRID_COVERED = {"*": "attention", "-": "ffn"}
HYBRID_UNCOVERED = {"M": ("attention", "Mamba"), "G": ("attention", "Gated DeltaNet"),
                    "D": ("attention", "DeepSeek sparse attention"), "+": ("attention", "multi-latent attention"),
                    "E": ("ffn", "MoE")}


def local_hybrid_stack_spec() -> ModuleSpec:
    """The dense Qwen3-shaped HybridStack spec without Transformer Engine (what a 0.19 user without TE
    writes; the stock ``hybrid_stack_spec`` is TE-only and has no q/k norms): ``attention_layer`` = the
    local GPT layer's attention half (input RMSNorm, SelfAttention with q/k RMSNorm), ``mlp_layer`` =
    ``MLPLayer`` with its MLP half. Use with ``hybrid_layer_pattern="*-" * num_gpt_layers``."""
    h = _hybrid_or_raise()
    s = _compat.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules
    layer_sub = _compat.TransformerLayerSubmodules
    return ModuleSpec(module=h.HybridStack, submodules=h.HybridStackSubmodules(
        attention_layer=ModuleSpec(module=_compat.TransformerLayer, submodules=layer_sub(
            input_layernorm=s.input_layernorm, self_attention=s.self_attention, self_attn_bda=s.self_attn_bda)),
        mlp_layer=ModuleSpec(module=h.MLPLayer, submodules=layer_sub(
            pre_mlp_layernorm=s.pre_mlp_layernorm, mlp=s.mlp, mlp_bda=s.mlp_bda))))


def _hybrid_or_raise():
    h = _compat.hybrid()
    if h is None:
        raise _state.RlkPolicyError(f"megatron-core {_compat.version()} has no HybridModel "
                                    "(megatron.core.models.hybrid, new in 0.19)")
    return h


def rlk_hybrid_stack_spec(config, *, rope_theta: float, base: ModuleSpec | None = None) -> ModuleSpec:
    """``HybridModel(hybrid_stack_spec=...)`` with rlk in the R modules' slots: the ``attention_layer``
    slot's attention half (module attention), the ``mlp_layer`` slot's MLP half (module ffn) and, for an
    R logp, the stack's final norm (HybridStack builds it as ``TENorm`` itself, so the stack class becomes
    a subclass that builds an rlk RMSNorm instead). ``base``: the stack spec to start from (default
    :func:`local_hybrid_stack_spec`; Megatron's TE ``hybrid_stack_spec`` works too, its fused
    norm+linear slots replaced by unfused rlk ones for R modules). Every other slot stays stock."""
    h = _hybrid_or_raise()
    st = _state.get()
    if base is None:
        base = local_hybrid_stack_spec()
    active = _active(config, hybrid=True)
    if not (isinstance(base, ModuleSpec) and isinstance(base.module, type) and issubclass(base.module, h.HybridStack)
            and isinstance(base.submodules, h.HybridStackSubmodules)):
        for m in ("attention", "ffn", "logp"):
            if active[m]:
                st.refuse(m, f"the base hybrid stack spec is not a HybridStack spec: {base!r}")
        return base
    sub = base.submodules
    changes = {
        "attention_layer": _layer_spec(config, rope_theta, sub.attention_layer, ("attention",), active,
                                       "HybridStack attention_layer "),
        "mlp_layer": _layer_spec(config, rope_theta, sub.mlp_layer, ("ffn",), active, "HybridStack mlp_layer "),
    }
    module = _rlk_final_norm_stack(base.module) if active["logp"] else base.module
    return ModuleSpec(module=module, params=dict(base.params), submodules=dataclasses.replace(sub, **changes))


_FINAL_NORM_STACKS: dict[type, type] = {}


def _rlk_final_norm_stack(cls: type) -> type:
    """``cls`` (a HybridStack class) with its final norm an rlk RMSNorm (module logp)."""
    if cls not in _FINAL_NORM_STACKS:
        def __init__(self, *args, post_layer_norm: bool = True, **kwargs):
            cls.__init__(self, *args, post_layer_norm=False, **kwargs)  # no TENorm built
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = RlkRMSNorm(self.config, self.config.hidden_size, eps=self.config.layernorm_epsilon,
                                             rlk_module="logp")

        _FINAL_NORM_STACKS[cls] = type(f"Rlk{cls.__name__}", (cls,), {"__init__": __init__,
                                                                      "__module__": __name__})
    return _FINAL_NORM_STACKS[cls]


def layer_modules(model) -> dict[str, list]:
    """The model's layers per rlk module (what :func:`verify_model` checks); GPTModel and HybridModel
    (a hybrid layer that is not a TransformerLayer, e.g. Mamba, counts as attention: a sequence mixer)."""
    out: dict[str, list] = {"attention": [], "ffn": [], "logp": []}
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", []):
        if isinstance(layer, _compat.TransformerLayer):
            out["attention"] += [layer.input_layernorm, *layer.self_attention.modules()]
            out["ffn"] += [layer.pre_mlp_layernorm, *layer.mlp.modules()]
        else:
            out["attention"] += list(layer.modules())
    for name in ("final_layernorm", "final_norm"):  # GPT's TransformerBlock, HybridStack
        if getattr(decoder, name, None) is not None:
            out["logp"].append(getattr(decoder, name))
    if getattr(model, "output_layer", None) is not None:
        out["logp"].append(model.output_layer)
    return out


def hybrid_problems(model) -> dict[str, list[str]]:
    """Per module, the HybridModel layer types in the built model that rlk does not cover (empty for a
    GPTModel or a dense ``*-`` pattern)."""
    out: dict[str, list[str]] = {"attention": [], "ffn": [], "logp": []}
    types_ = getattr(getattr(model, "decoder", None), "layer_type_list", None) or []
    for sym in sorted(set(types_)):
        if sym in HYBRID_UNCOVERED:
            module, what = HYBRID_UNCOVERED[sym]
            out[module].append(f"HybridModel layer {sym!r} ({what}) is not covered "
                               f"(pattern {getattr(model, 'hybrid_layer_pattern', None)!r}; rlk covers '*' and '-')")
        elif sym not in HYBRID_COVERED:
            out["attention"].append(f"HybridModel layer {sym!r} is not known to rlk")
    return out


def verify_model(model) -> dict[str, int]:
    """Check a built model against the plan: every compute layer of an R module is an active rlk layer,
    no layer of a P module is. Raises (strict) or records (audit); returns rlk layer counts per module."""
    st = _state.get()
    counts = {}
    problems = hybrid_problems(model)
    for module, mods in layer_modules(model).items():
        rlk = [m for m in mods if isinstance(m, (_RlkLayer, RlkCoreAttention))]
        active = [m for m in rlk if getattr(m, "rlk_active", True)]
        counts[module] = len(active)
        if st.rlk(module):
            if problems[module]:  # HybridModel layer types rlk does not cover (audit: recorded, counted)
                st.refuse(module, "; ".join(problems[module]))
            compute = [m for m in mods if _is_compute(m)]
            missing = [type(m).__name__ for m in compute if not isinstance(m, (_RlkLayer, RlkCoreAttention))
                       or not getattr(m, "rlk_active", True)]
            if missing:
                st.refuse(module, f"the built model runs Megatron layers for it: {sorted(set(missing))}")
        elif active:
            raise _state.RlkPolicyError(f"module {module!r} is P but the model holds rlk layers "
                                        f"{sorted({type(m).__name__ for m in active})}")
    return counts


def _is_compute(m) -> bool:
    name = type(m).__name__
    return any(k in name for k in ("Linear", "Norm", "CoreAttention", "DotProductAttention", "MLP"))


def prepare_model(model) -> dict[str, int]:
    """Finish a built ``GPTModel`` (idempotent): rlk LM head for an R logp, production recording on P
    modules' layers, the model's maximum length on every rlk core attention (its rope table is reserved for
    it and longer batches are refused), then :func:`verify_model`."""
    st = _state.get()
    longest = getattr(model, "max_sequence_length", None) or getattr(model, "max_position_embeddings", None)
    for m in model.modules():
        if isinstance(m, RlkCoreAttention):
            m.max_positions = int(longest) if longest else None
    if st.rlk("logp") and getattr(model, "output_layer", None) is not None:
        problems = model_problems(model.config)["logp"]
        if not problems or st.refuse("logp", "; ".join(problems)):
            patches.use_rlk_output_layer(model.output_layer)
    patches.record_production_calls(model, layer_modules(model), st)
    check_collectives_once(model)
    return verify_model(model)


def check_collectives_once(model) -> int:
    """Keep the cross-rank metadata check of rlk's TP / CP collectives (``check=True``: an all-gather of a
    small vector and a host read — two host syncs per call, four calls per layer at TP > 1) in the first
    layer of each kind only (first in module order: the first TransformerLayer's QKV, output projection,
    fc1, fc2 and core attention; the LM head); every later layer calls them with ``check=False``. As strong
    as checking every layer: the metadata a call site exchanges (dtype, widths, the step's token count) is
    the same in every layer of a step, so ranks that disagree disagree in the first layer already, whose
    calls still raise the same error on every rank. Every rank holds the same layers in the same order, so
    all make the same choice (a check on one rank and none on another would pair mismatched collectives).
    Returns the number of layers left checking."""
    first: set[tuple] = set()
    for m in model.modules():
        if isinstance(m, (_RlkLayer, RlkCoreAttention)):
            kind = (type(m), getattr(m, "rlk_module", "attention"))
            m.rlk_check_collectives = kind not in first
            first.add(kind)
    return len(first)
