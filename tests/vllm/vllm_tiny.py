"""Helpers of the scripts the vLLM tests run in a fresh Python (``run_script`` puts this folder on PYTHONPATH):
:func:`tiny_model`, a tiny Qwen3 built by vLLM's own model loader, and :func:`engine_core`, the target of the child
process in test_multiprocess_readbacks.py (a module, so that a spawned child can import it)."""

from __future__ import annotations

import signal
import tempfile
import threading


def tiny_model(cfg=None, weights=None):
    """``(VllmConfig, model)``: a 2-layer Qwen3 with random bf16 weights (or the model of ``cfg``, a
    ``rlk_repro.model.config.Qwen3Config``, with ``weights``: e.g. a Qwen3-MoE), loaded by vLLM's model loader in this
    process (gloo, world size 1), as an engine core with the uni-process executor loads its model."""
    import torch
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader

    from rlk_repro.model import weights as W
    from rlk_repro.model.config import Qwen3Config

    if cfg is None:
        cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    d = tempfile.mkdtemp()
    W.save_checkpoint(d, cfg, weights if weights is not None else W.random_weights(cfg, seed=3, dtype=torch.bfloat16))
    mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype=torch.bfloat16, enforce_eager=True)
    vc = VllmConfig(model_config=mc, compilation_config=CompilationConfig(mode=0))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist", local_rank=0,
                                     backend="gloo")
        initialize_model_parallel(1, 1)
        return vc, get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)


def engine_core(ready) -> None:
    """As vLLM's ``EngineCoreProc.run_engine_core`` with the uni-process executor, as far as the plugin sees it: the
    general plugins loaded, the model built here, some of its layers run, then a busy loop that vLLM's shutdown ends
    with SIGTERM."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does first: rlk's entry point registers here
    vc, model = tiny_model()  # the plugin flushes its readback after the load (hooks installed, nothing run yet)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with set_current_vllm_config(vc), torch.no_grad():
        model.model.layers[0].mlp(model.model.layers[0].post_attention_layernorm(x))  # ffn: norm, linears, SwiGLU
        model.model.norm(x)  # logp: the final norm
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # vLLM's handler: leave the busy loop, return normally
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ready.set()
    stop.wait()
