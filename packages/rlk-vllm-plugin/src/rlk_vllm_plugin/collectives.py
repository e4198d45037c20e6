"""The tensor-parallel all-reduce: ``GroupCoordinator._all_reduce_out_place`` -> ``rlk_collectives.all_reduce``.

Every TP all-reduce of vLLM (``tensor_model_parallel_all_reduce`` -> ``GroupCoordinator.all_reduce`` ->
``torch.ops.vllm.all_reduce`` on CUDA -> ``_all_reduce_out_place``) reaches this method of the TP group
(``unique_name`` ``tp:*``), below the custom op that compiled graphs keep opaque and above the device
communicator, so vLLM's custom all-reduce, quick-reduce, symmetric-memory and FlashInfer paths are not
reached for an R module. Other groups and non-floating-point tensors go to vLLM's own path.

Which module a reduction belongs to: the row-parallel linear layer that ran just before it in this
thread (``o_proj`` -> attention, ``down_proj`` -> ffn). Where that is unknown (a compiled graph replays
the GEMMs without the Python hook, or the input embedding's masked sum), the plan decides when attention
and ffn agree; a mixed plan that cannot be told apart is a violation.
"""

from __future__ import annotations

from rlk_vllm_plugin import _compat, _runtime

TARGET = "vllm.distributed.parallel_state.GroupCoordinator._all_reduce_out_place"


def _module_for(rt: _runtime.Runtime) -> tuple[str | None, bool]:
    """(module to record under, whether rlk reduces)."""
    module = _runtime.take_linear_module()
    if module in ("attention", "ffn"):
        return module, rt.r(module)
    r_att, r_ffn = rt.r("attention"), rt.r("ffn")
    if r_att == r_ffn:
        return ("attention" if r_att else None), r_att
    rt.violation("a TP all-reduce ran outside a hooked linear layer under a plan whose attention and ffn "
                 "routes differ; rlk cannot tell which module it belongs to")
    return "attention" if r_att else "ffn", True


def _all_reduce_out_place(original):
    def all_reduce_out_place(self, input_):
        if not str(getattr(self, "unique_name", "")).startswith("tp:") or not input_.is_floating_point():
            return original(self, input_)
        rt = _runtime.get()
        module, use_rlk = _module_for(rt)
        if not use_rlk:
            _runtime.production(module, "all_reduce", "production.vllm.device_communicator.all_reduce")
            return original(self, input_)
        import rlk_collectives
        with rt.recorder.scope(module):
            return rlk_collectives.all_reduce(input_, self.device_group, check=False)
    all_reduce_out_place._rlk_original = original
    return all_reduce_out_place


def install(probe: _compat.Probe) -> list[str]:
    _runtime.patch(_compat.module("vllm.distributed.parallel_state").GroupCoordinator, "_all_reduce_out_place",
           _all_reduce_out_place)
    return [TARGET]


def uninstall() -> None:
    _runtime.unpatch(_compat.module("vllm.distributed.parallel_state").GroupCoordinator, "_all_reduce_out_place")


def check_config(rt: _runtime.Runtime) -> None:
    """Compile passes at TP > 1 that take the TP collectives out of rlk's hands, refused for attention / ffn R:

    - ``fuse_allreduce_rms`` (vLLM 0.22): the all-reduce + RMSNorm pair becomes a fused kernel that bypasses both
      hooks;
    - ``enable_sp`` (sequence parallelism) and ``fuse_gemm_comms`` (async TP, which turns ``enable_sp`` on): the
      all-reduce becomes vLLM's reduce-scatter + all-gather (async TP: fused into the GEMMs), which neither
      ``rlk_collectives``' rank tree nor, in invariant mode, ``rlk.gemm.tp.v1``'s fp32 merge runs. vLLM turns both on
      by default for dense models at ``-O2`` / ``-O3`` with TP > 1; they run only where vLLM compiles the model
      (not under ``enforce_eager`` / ``-cc.mode=none``, which is accepted). Not routed through rlk in this version:
      ``rlk_collectives.reduce_scatter_partials`` has the arithmetic (SP on == SP off), but vLLM's pass rewrites its
      own graph patterns, which rlk's layers do not produce."""
    cfg = _compat.current_vllm_config()
    if cfg is None or not (rt.r("attention") or rt.r("ffn")):
        return
    tp = getattr(getattr(cfg, "parallel_config", None), "tensor_parallel_size", 1)
    pass_config = getattr(getattr(cfg, "compilation_config", None), "pass_config", None)
    if tp <= 1:
        return
    if getattr(pass_config, "fuse_allreduce_rms", False):
        rt.violation("vLLM's fuse_allreduce_rms compile pass is on with TP > 1; it bypasses rlk's all-reduce and "
                     "RMSNorm. Pass -cc.pass_config.fuse_allreduce_rms=false")
    compiled = int(getattr(getattr(cfg, "compilation_config", None), "mode", 0) or 0) != 0  # CompilationMode.NONE
    on = [name for name in ("enable_sp", "fuse_gemm_comms") if getattr(pass_config, name, False)]
    if on and compiled:
        mode = (f"RL_KERNEL_TP_INVARIANT={rt.tp_leaves}'s fp32 row-parallel merge (rlk.gemm.tp.v1)" if rt.tp_leaves
                else "rlk's rank-order all-reduce (rlk.collective.v1)")
        rt.violation(f"vLLM's sequence-parallel / async-TP compile passes ({', '.join(on)}) are on at TP {tp}: they "
                     f"replace the TP all-reduce with vLLM's reduce-scatter + all-gather, which bypass {mode}; "
                     "rlk does not route them. Pass "
                     + " ".join(f"-cc.pass_config.{name}=false" for name in ("enable_sp", "fuse_gemm_comms"))
                     + " (vLLM turns them on by default at -O2 / -O3 for dense models with TP > 1)")


__all__ = ["TARGET", "check_config", "install", "uninstall"]
