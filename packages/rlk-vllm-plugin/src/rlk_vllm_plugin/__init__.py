"""rlk-vllm-plugin: the rollout side of rlk's routes inside vLLM.

:func:`register` is the ``vllm.general_plugins`` entry point (name ``rlk``; a deployment that sets
``VLLM_PLUGINS`` must list it). vLLM calls it in every process — front end, engine core, each worker —
before the model is built. Importing this package imports nothing from vLLM and changes nothing; every
check runs inside :func:`register`, where an exception stops vLLM (that is how strict mode fails
closed — an exception at import time would make vLLM skip the plugin silently).

What is installed for each module whose rollout letter is ``R`` (see ``PATCHES.md`` for the inventory):

- ``ffn``: out-of-tree ``RMSNorm`` / ``SiluAndMul`` (:mod:`.layers`), the linear method;
- ``attention``: out-of-tree ``RMSNorm`` / ``RotaryEmbedding``, the linear method, the ``CUSTOM``
  attention backend (:mod:`.attention`);
- ``logp``: the final ``RMSNorm``, the LM-head method, the sampled-token log-prob hook (:mod:`.logprobs`);
- ``attention`` or ``ffn``: the TP all-reduce (:mod:`.collectives`); with ``RL_KERNEL_TP_INVARIANT``, the
  row-parallel linear at TP > 1 (:mod:`.row_parallel`).

For ``P`` modules — every module of a native run, where every rollout letter is ``P`` — only counting is
installed: the out-of-tree ``RMSNorm`` / ``SiluAndMul`` and the linear / LM-head methods call vLLM's own
method unchanged and count it (``production.vllm.<class>``), the model loader binds layers to modules and
flushes the readback, and the readback is flushed at exit. Nothing that changes vLLM's arithmetic (RoPE,
the attention backend, log-probs, the TP all-reduce) is installed for a ``P`` module. Under
``torch.compile`` the compiled call sites are recorded instead of run-time calls (:mod:`._runtime`).
"""

from __future__ import annotations

import logging
import os

__version__ = "0.1.0"
log = logging.getLogger("rlk.vllm")
ENTRY_POINT = "rlk"
_REGISTERED: tuple | None = None


def _key(rt) -> tuple:
    return (rt.plan, rt.mode, rt.unfiltered_logprobs, rt.attention_override, rt.tp_leaves, os.getpid())


def register() -> None:
    """vLLM general-plugin entry point: install the rollout side of the route plan in this process.

    Idempotent: a second call with the same configuration does nothing; a call whose environment asks for
    a different plan raises :class:`~rlk_core.errors.RlkConfigError`. Strict mode
    (``RL_KERNEL_MODE=strict``, the default): a vLLM outside the supported range, or one missing a hook
    target an ``R`` module needs, raises :class:`~rlk_core.errors.RlkPolicyError` naming what is missing.
    Audit mode: the same is logged and recorded as a fallback in the readback, and nothing is installed.
    All ``P`` (a native run) never raises for these: it installs counting only, or nothing (logged).
    """
    global _REGISTERED
    from rlk_core.errors import RlkConfigError, RlkPolicyError
    from rlk_vllm_plugin import _runtime

    rt = _runtime.Runtime.from_env()
    if _REGISTERED is not None:
        if _REGISTERED[:-1] != _key(rt)[:-1]:
            raise RlkConfigError(f"rlk-vllm-plugin is installed for plan {_REGISTERED[0].name} "
                                 f"(mode {_REGISTERED[1]}); register() was called again with plan {rt.plan.name} "
                                 f"(mode {rt.mode})")
        return
    wanted = rt.wanted()
    problem = _probe_problem(rt)
    if isinstance(problem, str):
        if not wanted:  # a native run: never stop vLLM; the readback then records no module
            log.warning("rlk: %s; vLLM runs as built and its calls are not counted", problem)
            _runtime.install(rt)
            _runtime.flush_at_exit()
            rt.flush()
        elif rt.strict:
            raise RlkPolicyError(problem)
        else:
            log.warning("rlk audit: %s (vLLM's production operators stay in place)", problem)
            _runtime.install(rt)
            _runtime.flush_at_exit()
            for module in wanted:
                rt.recorder.count(module, "register", "production.vllm.unhooked", None, fallback_reason=problem)
        _REGISTERED = _key(rt)
        return
    _install(rt, problem)
    _REGISTERED = _key(rt)


def _groups(wanted: list[str], tp_invariant: bool = False) -> tuple[str, ...]:
    groups = ["common", "count", *wanted]
    if "attention" in wanted or "ffn" in wanted:
        groups.append("tp")
        if tp_invariant:
            groups.append("tp_invariant")
    return tuple(groups)


def _probe_problem(rt):
    """The probe of the installed vLLM, or a message naming why the plan cannot be installed."""
    from rlk_vllm_plugin import _compat

    wanted = rt.wanted()
    head = (f"rlk-vllm-plugin {__version__}: the plan asks R on the rollout side of {', '.join(wanted)}, but"
            if wanted else f"rlk-vllm-plugin {__version__}: every rollout letter is P (counting only), but")
    try:
        probe = _compat.probe(_groups(wanted, bool(rt.tp_leaves)))
    except ImportError as exc:
        return f"{head} vLLM cannot be imported ({exc})"
    if not _compat.in_range(probe.version):
        low, high = _compat.SUPPORTED
        return (f"{head} vLLM {probe.version} is outside the supported range "
                f"{low[0]}.{low[1]} <= version < {high[0]}.{high[1]}")
    if probe.missing:
        return f"{head} vLLM {probe.version} lacks: " + "; ".join(probe.missing)
    return probe


def _install(rt, probe) -> None:
    from rlk_vllm_plugin import _runtime, attention, collectives, cudagraphs, layers, logprobs, row_parallel

    _runtime.install(rt)
    _runtime.flush_at_exit()
    graphs = cudagraphs.install()  # issue 37: the CUDA-graph evidence (counting only, every plan)
    if graphs is not None:
        rt.add_hook("cuda_graphs", graphs, "patch")
    names = ["RMSNorm", "SiluAndMul", "UnquantizedFusedMoEMethod"]  # R: the rlk op; P: vLLM's own, counted
    if rt.r("attention"):
        names.append("RotaryEmbedding")
    layers.oot_classes(probe)
    for name in layers.register_oot(probe, names):
        rt.add_hook(f"oot.{name}", f"vllm CustomOp {name}", "custom_op_oot")
    layers.install_loader(probe)
    rt.add_hook("model_loader", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model",
                "patch")
    layers.install_linear(probe)  # R: rlk linear; P: the original, counted
    rt.add_hook("linear", "vllm.model_executor.layers.linear.UnquantizedLinearMethod.apply", "patch")
    layers.install_lm_head(probe)
    rt.add_hook("lm_head", "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod.apply",
                "patch")
    if rt.r("attention") or rt.r("ffn"):
        for target in collectives.install(probe):
            rt.add_hook("tp_all_reduce", target, "patch")
        if rt.tp_leaves:  # issue 35: the row-parallel linear at TP > 1 under rlk.gemm.tp.v1
            rt.add_hook("row_parallel_linear", row_parallel.install(probe), "pluggable_layer_oot")
    if rt.r("attention"):
        for name in attention.install(probe, rt.attention_override):
            rt.add_hook(f"attention_backend.{name}", attention.BACKEND_PATH, "attention_backend")
    if rt.r("logp"):
        for target in logprobs.install(probe):
            rt.add_hook("logprobs", target, "patch")
    else:  # issue 40: the sampler's requests are counted under every plan (greedy ones are not comparable)
        for target in logprobs.install_counting():
            rt.add_hook("sampling_counts", target, "patch")
    log.info("rlk-vllm-plugin %s: vLLM %s, plan %s, mode %s, installed %d hooks", __version__, probe.version,
             rt.plan.name, rt.mode, len(rt.hooks))
    rt.flush()


def uninstall() -> None:
    """Restore every vLLM attribute the plugin replaced (tests; a process that wants vLLM back as built)."""
    global _REGISTERED
    from rlk_vllm_plugin import _runtime

    if _REGISTERED is not None and _runtime.current() is not None:
        from rlk_vllm_plugin import attention, collectives, cudagraphs, layers, logprobs, row_parallel
        cudagraphs.uninstall()
        row_parallel.uninstall()
        layers.uninstall()
        logprobs.uninstall()
        collectives.uninstall()
        attention.uninstall()
    _runtime.install(None)
    _REGISTERED = None


def flush() -> None:
    """Write this process's readback now (it is also written at exit and after each model load)."""
    from rlk_vllm_plugin import _runtime

    rt = _runtime.current()
    if rt is not None:
        rt.flush()
