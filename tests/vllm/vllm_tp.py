"""The ranks of test_tp_invariant.py's TP > 1 test (a module, so that the scripts' forked children share it): real vLLM
``RowParallelLinear`` layers built after the plugin registered, on vLLM's own process groups (gloo), weights loaded
through the layers' own ``weight_loader`` (each rank keeps its K slice), run under three plans:

- ``invariant``: R/R with ``RL_KERNEL_TP_INVARIANT=8`` (the path under test);
- ``bi``: R/R without the mode (rlk.gemm.bi.v1 per rank + rlk's rank-order all-reduce of the bf16 outputs);
- ``native``: P/P (vLLM's own GEMM and all-reduce).

Each rank saves ``{tp: {plan: {layer: output}}}`` plus its readback and refusals to ``<out>/rank<r>.pt``."""

from __future__ import annotations

import os

G = 8
M, N, K_ATT, K_FFN = 5, 48, 256, 512  # M = 5 rows: awkward on purpose
PLANS = {"invariant": ("R/R", "8"), "bi": ("R/R", "off"), "native": ("P/P", "off")}
# name -> (vLLM prefix, K, kwargs of RowParallelLinear)
LAYERS = {
    "o_proj": ("model.layers.0.self_attn.o_proj", K_ATT, {"bias": False}),
    "down_proj_bias_replicated_input": ("model.layers.0.mlp.down_proj", K_FFN,
                                        {"bias": True, "input_is_parallel": False}),
    "down_proj_skip_bias_add": ("model.layers.1.mlp.down_proj", K_FFN, {"bias": True, "skip_bias_add": True}),
}


def inputs(name: str):
    """``(x [M, K], weight [N, K], bias [N] or None)`` of layer ``name``, the same on every rank and in the parent."""
    import torch

    _, k, kw = LAYERS[name]
    gen = torch.Generator().manual_seed(k + len(name))
    x = torch.randn(M, k, generator=gen).bfloat16()
    w = (torch.randn(N, k, generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(N, generator=gen).bfloat16() if kw.get("bias") else None
    return x, w, b


def _register(plan: str) -> None:
    import rlk_vllm_plugin

    case, leaves = PLANS[plan]
    rlk_vllm_plugin.uninstall()
    for m in ("ATTENTION", "FFN", "LOGP"):
        os.environ[f"RL_KERNEL_{m}_CASE"] = case if m != "LOGP" else "P/P"
    os.environ["RL_KERNEL_TP_INVARIANT"] = leaves
    rlk_vllm_plugin.register()


def _build(name: str, tp: int):
    import torch
    from vllm.model_executor.layers.linear import RowParallelLinear

    prefix, k, kw = LAYERS[name]
    layer = RowParallelLinear(k, N, params_dtype=torch.bfloat16, prefix=prefix, **kw)
    x, w, b = inputs(name)
    layer.weight.weight_loader(layer.weight, w)  # vLLM's own sharding: rank r keeps K columns [r K/tp, (r+1) K/tp)
    if b is not None:
        layer.bias.weight_loader(layer.bias, b)
    layer.quant_method.process_weights_after_loading(layer)  # as vLLM's loader does (the CPU GEMM's setup)
    if not kw.get("input_is_parallel", True):
        return layer, x  # the replicated input: the layer takes its own slice
    return layer, x.chunk(tp, dim=-1)[layer.tp_rank].contiguous()


def _run(tp: int) -> dict:
    import torch
    from vllm.model_executor.layers.linear import RowParallelLinear

    from rlk_core.errors import RlkPolicyError
    from rlk_vllm_plugin import _runtime

    out: dict = {}
    for plan in PLANS:
        _register(plan)
        res: dict = {}
        for name in LAYERS:
            layer, x_in = _build(name, tp)
            res["class." + name] = type(layer).__name__
            with torch.no_grad():
                y, bias = layer(x_in)
            res[name] = y
            res["bias." + name] = None if bias is None else bias.data.clone()
        if plan == "invariant":  # vLLM compiles with fullgraph=True: the layer must trace whole (no graph break)
            layer, x_in = _build("o_proj", tp)
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False)
            with torch.no_grad():
                res["compiled.o_proj"] = compiled(x_in)[0]
        if plan == "invariant" and tp > 1:  # strict refusal: a layer whose caller reduces would round before the merge
            try:
                RowParallelLinear(K_ATT, N, bias=False, reduce_results=False, params_dtype=torch.bfloat16,
                                  prefix=LAYERS["o_proj"][0])
                res["refusal"] = None
            except RlkPolicyError as exc:
                res["refusal"] = str(exc)
        res["readback"] = _runtime.current().recorder.to_dict()["modules"]
        out[plan] = res
    return out


def rank_main(rank: int, world: int, init: str, out_dir: str, tps: tuple[int, ...]) -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, init_distributed_environment, initialize_model_parallel

    torch.set_num_threads(1)
    results = {}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"file://{init}",
                                     local_rank=rank, backend="gloo")
        for tp in tps:  # world 4: TP 4, TP 2 (two TP groups of vLLM's own layout: ranks 0-1, 2-3), TP 1 (four)
            initialize_model_parallel(tp, 1)
            results[tp] = _run(tp)
            destroy_model_parallel()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
