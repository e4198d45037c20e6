"""The provider's unavoidable patches, one function per target, each with its header.

Everything else goes through Megatron's extension points (layer specs, :mod:`rlk_megatron_provider.spec`).
Every function here is idempotent and records itself as a hook in the readback.
"""

from __future__ import annotations

import importlib

from rlk_megatron_provider import _state


def use_rlk_output_layer(layer) -> None:
    """Target: ``GPTModel.output_layer`` (an instance of Megatron's ``ColumnParallelLinear``).

    Why: the LM head is not spec-swappable — ``GPTModel.__init__`` hard-codes
    ``tensor_parallel.ColumnParallelLinear`` (megatron-core 0.16.1 and 0.19.2) — and for an R ``logp``
    its logits must be the rlk GEMM's (the logits slime's log-prob function receives).
    How: the instance's class becomes :class:`rlk_megatron_provider.logp.RlkOutputLayer`, a subclass that
    only overrides ``forward``; parameters, sharding attributes and state-dict keys are untouched.
    Upstream status: none (no LM-head slot in ``ModuleSpec`` / the spec providers).
    Remove when: Megatron builds the output layer from a spec or provider slot.
    """
    from rlk_megatron_provider.logp import RlkOutputLayer

    if isinstance(layer, RlkOutputLayer):
        return
    from rlk_megatron_provider import _compat

    if type(layer) is not _compat.ColumnParallelLinear:
        _state.get().refuse("logp", f"output_layer is {type(layer).__name__}, not ColumnParallelLinear "
                                    "(TE LM heads are not covered)")
        return
    layer.__class__ = RlkOutputLayer
    layer._rlk_init()
    _state.get().recorder.add_hook("rlk_output_layer", "megatron.core GPTModel.output_layer", "class-swap")


def record_production_calls(model, modules: dict[str, list], st) -> None:
    """Target: the compute layers of P modules (forward pre-hooks, no change to what they compute).

    Why: the readback must say what ran for every module, P included ("production.megatron.<class>").
    How: ``register_forward_pre_hook`` counting one call per layer call (an in-memory dict update).
    Upstream status: uses the public ``torch.nn.Module`` hook API; not a Megatron change.
    Remove when: never needed to remove (evidence only).
    """
    if getattr(model, "_rlk_production_hooks", False):
        return
    ops = (("CoreAttention", "attention_varlen"), ("DotProductAttention", "attention_varlen"),
           ("Linear", "linear"), ("Norm", "rms_norm"), ("MLP", "swiglu"))
    for module, layers in modules.items():
        if st.rlk(module):
            continue
        for layer in layers:
            name = type(layer).__name__
            op = next((o for key, o in ops if key in name), None)
            if op is None:
                continue
            backend = f"{_state.PRODUCTION}.{name}"

            def hook(_mod, _args, module=module, op=op, backend=backend):
                st.routes.production(module, op, backend)

            layer.register_forward_pre_hook(hook)
    model._rlk_production_hooks = True
    st.recorder.add_hook("production_recording", "P modules' layers", "forward-pre-hook")


SLIME_LOSS = "slime.backends.megatron_utils.loss"
SLIME_NAME = "calculate_log_probs_and_entropy"


def bind_slime_logprobs(module_name: str = SLIME_LOSS) -> bool:
    """Target: ``slime.backends.megatron_utils.loss.calculate_log_probs_and_entropy`` (the name as bound in
    slime's ``loss`` module, which imports it from ``slime.utils.ppo_utils`` by name).

    Why: slime computes training log-probs from the vocab-parallel logits with its own all-reduces
    (``_maybe_all_reduce``), which no Megatron hook reaches; an R ``logp`` must compute the rlk contract.
    How: the module attribute is replaced by :func:`rlk_megatron_provider.logp.slime_log_probs_and_entropy`
    (same signature, same return structure). Absent slime: nothing to bind (returns False). slime present
    but the name missing: refused (strict) / recorded (audit).
    Upstream status: slime has no provider hook; VIME's ``--linear-logp-provider`` is the formal ABI.
    Remove when: slime offers a log-prob provider flag.
    """
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return False
    from rlk_megatron_provider.logp import slime_log_probs_and_entropy

    current = getattr(mod, SLIME_NAME, None)
    if current is slime_log_probs_and_entropy:
        return True
    if current is None:
        _state.get().refuse("logp", f"{module_name} has no attribute {SLIME_NAME!r} (slime version not covered)")
        return False
    mod._rlk_original_calculate_log_probs_and_entropy = current
    setattr(mod, SLIME_NAME, slime_log_probs_and_entropy)
    _state.get().recorder.add_hook("slime_log_probs", f"{module_name}.{SLIME_NAME}", "module-attribute")
    return True
