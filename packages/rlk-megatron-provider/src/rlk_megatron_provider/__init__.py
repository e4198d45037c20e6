"""rlk-megatron-provider: the train side of rlk's routes inside Megatron-core.

Importing has no side effects (megatron.core is imported only when a function needs it). Entry points,
all idempotent:

- :func:`install` — ``--custom-megatron-init-path rlk_megatron_provider.install`` (slime / VIME call it as
  ``fn(args)`` at the end of Megatron's initialisation, in every training process): reads the plan from
  ``RL_KERNEL_*``, checks the Megatron version, builds the readback recorder and, for an R ``logp``,
  binds slime's log-prob function when slime is importable;
- :func:`initialize_from_environment` — the same for plain Megatron-core scripts;
- :func:`layer_spec` / :func:`block_spec` / :func:`prepare_model` — the layer spec with rlk in the R
  modules' slots (stock slots kept for P modules) and the post-build step (see
  :mod:`rlk_megatron_provider.spec`); :func:`hybrid_stack_spec` — the same for megatron-core 0.19's
  ``HybridModel`` (dense ``"*-"`` patterns);
- :func:`linear_logp` — VIME's ``--linear-logp-provider`` callable;
- :func:`slime_spec` — slime's ``--spec rlk_megatron_provider slime_spec`` (a model provider built on the
  layer spec) and :func:`record_logprobs` — ``--custom-tis-function-path``, the per-rank train/rollout
  log-prob records (see :mod:`rlk_megatron_provider.slime_hooks`);
- :func:`invalidate_weight_caches` — after writing parameters through ``param.data`` outside an optimizer
  step (optimizer steps invalidate the caches themselves).

Strict mode (``RL_KERNEL_MODE=strict``): an R module that cannot be installed raises
:class:`~rlk_core.errors.RlkPolicyError` naming the module and the reason; audit mode records the
fallback in the readback and leaves Megatron's layers in place.
"""

from __future__ import annotations

import logging
from typing import Any

__version__ = "0.1.0"
log = logging.getLogger("rlk.megatron")


def initialize_from_environment():
    """Install the train side of the plan read from ``RL_KERNEL_*`` in this process; returns the
    provider state (plan, recorder, routes). Calling it again returns the same state."""
    import torch.distributed as dist

    from rlk_core.plan import MODULES, RoutePlan
    from rlk_megatron_provider import _state

    st = _state.current()
    if st is not None:
        return st
    plan = RoutePlan.from_env()
    ready = dist.is_available() and dist.is_initialized()
    st = _state.build(plan, None, dist.get_rank() if ready else 0, dist.get_world_size() if ready else 1)
    wanted = [m for m in MODULES if plan.uses_rlk(m, "train")]
    try:
        _check_installable(st, wanted)
    except BaseException:
        _state.reset()  # a refused install leaves nothing behind: the next call checks again
        raise
    return st


def _check_installable(st, wanted: list[str]) -> None:
    if wanted:
        try:
            from rlk_megatron_provider import _compat
        except ImportError as exc:
            for m in wanted:
                st.refuse(m, f"megatron.core cannot be imported: {exc}")
            return
        ok, reason = _compat.supported()
        if not ok:
            for m in wanted:
                st.refuse(m, reason)
        st.recorder.add_hook("rlk_megatron_provider", reason, "init")


def install(args: Any = None):
    """``--custom-megatron-init-path rlk_megatron_provider.install``: :func:`initialize_from_environment`
    plus, for an R ``logp``, the slime binding (when slime is importable). ``args`` (Megatron's
    namespace) is read for checks only."""
    from rlk_megatron_provider import _state, patches

    st = initialize_from_environment()
    if args is not None:
        _check_tp_layout(args, st)
    if args is not None and st.rlk("logp"):
        if getattr(args, "sequence_parallel", False):
            st.refuse("logp", "sequence_parallel=True is not covered by this version")
    if st.rlk("logp"):
        patches.bind_slime_logprobs()
    _state.get().recorder.add_hook("install", "--custom-megatron-init-path", "init")
    return st


def _check_tp_layout(args: Any, st) -> None:
    """slime's / VIME's arguments name both TPs (``--tensor-model-parallel-size``, ``--rollout-num-gpus-per-engine``):
    train TP != rollout TP without TP-invariant mode is refused in strict mode, saying what to set
    (:func:`rlk_core.tp.check_tp_layout`); audit mode records the problem as a hook of the readback."""
    from rlk_core.plan import MODULES
    from rlk_core.tp import check_tp_layout

    train_tp = getattr(args, "tensor_model_parallel_size", None)
    rollout_tp = getattr(args, "rollout_num_gpus_per_engine", None)
    if not (isinstance(train_tp, int) and isinstance(rollout_tp, int)) or not any(map(st.rlk, MODULES)):
        return
    problem = check_tp_layout(train_tp, rollout_tp, mode=st.mode)
    if problem is not None:
        st.recorder.add_hook("tp_layout", problem, "audit", installed=False)


def layer_spec(config, *, rope_theta: float, base=None):
    """See :func:`rlk_megatron_provider.spec.rlk_layer_spec`."""
    from rlk_megatron_provider import spec

    initialize_from_environment()
    return spec.rlk_layer_spec(config, rope_theta=rope_theta, base=base)


def block_spec(config, *, rope_theta: float, base=None):
    """See :func:`rlk_megatron_provider.spec.rlk_block_spec` (pass it as ``GPTModel``'s
    ``transformer_layer_spec``)."""
    from rlk_megatron_provider import spec

    initialize_from_environment()
    return spec.rlk_block_spec(config, rope_theta=rope_theta, base=base)


def hybrid_stack_spec(config, *, rope_theta: float, base=None):
    """See :func:`rlk_megatron_provider.spec.rlk_hybrid_stack_spec` (pass it as ``HybridModel``'s
    ``hybrid_stack_spec``; megatron-core >= 0.19)."""
    from rlk_megatron_provider import spec

    initialize_from_environment()
    return spec.rlk_hybrid_stack_spec(config, rope_theta=rope_theta, base=base)


def prepare_model(model):
    """See :func:`rlk_megatron_provider.spec.prepare_model`; call it on every built ``GPTModel`` or
    ``HybridModel``."""
    from rlk_megatron_provider import spec

    initialize_from_environment()
    return spec.prepare_model(model)


def linear_logp(request):
    """VIME's provider callable; see :func:`rlk_megatron_provider.logp.linear_logp`."""
    from rlk_megatron_provider import logp

    return logp.linear_logp(request)


def slime_spec(args, config, vp_stage=None):
    """See :func:`rlk_megatron_provider.slime_hooks.slime_spec`."""
    from rlk_megatron_provider import slime_hooks

    return slime_hooks.slime_spec(args, config, vp_stage)


def record_logprobs(args=None, **tis_kwargs):
    """See :func:`rlk_megatron_provider.slime_hooks.record_logprobs` (called by slime as ``fn(**tis_kwargs)``)."""
    from rlk_megatron_provider import slime_hooks

    return slime_hooks.record_logprobs(args, **tis_kwargs)


def flush_readback(directory=None):
    """Write this process's readback now (it is also written at exit)."""
    from rlk_megatron_provider import _state

    return _state.get().recorder.flush(directory)


def invalidate_weight_caches() -> None:
    """Mark the provider's cached weight-derived operands stale (the ``[q; k; v]`` copy of each QKV weight);
    see :func:`rlk_megatron_provider.layers.invalidate_weight_caches`. Optimizer steps do this themselves;
    call it after writing parameters through ``param.data`` without an optimizer step."""
    from rlk_megatron_provider import layers

    layers.invalidate_weight_caches()
