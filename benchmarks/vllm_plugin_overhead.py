"""Host time per call of rlk-vllm-plugin's hooks, without the ops they run (CPU, real vLLM, no GPU needed).

    RLK_TEST_VLLM_CPU_PLATFORM=1 python benchmarks/vllm_plugin_overhead.py [--profile] [--real-ops]

Builds a tiny Qwen3 with real vLLM (the CPU test platform of ``tests/vllm``, as ``tests/vllm/test_model.py``
does) under the all-R plan in strict mode, then calls each hook of the plugin the way vLLM's eager path does
(an uncaptured piecewise step runs every layer like this): the attention impl's ``forward`` (prefill and
decode metadata), ``UnquantizedLinearMethod.apply`` on the QKV projection, the RMSNorm (plain and fused with
the residual), SiluAndMul and RotaryEmbedding layers through ``CustomOp.forward``, and the LM head's
``UnquantizedEmbeddingMethod.apply``.

Each rlk op the route layer would run is replaced by a null op (:func:`_null_ops`) that reports to the
readback exactly as a public op does (``note_op_call``: the recorder's count in the active scope) and returns a
preallocated tensor of the right shape: what remains per hook call is the plugin's, ``_runtime``'s and the route
layer's own host time (``SideRoutes.call``, the readback scope and count), the part this script is for; the
op layer and the backends have their own benchmarks (``host_overhead.py --op-layer``). ``--real-ops`` keeps the
real ops instead (CPU kernels: the numbers then mostly measure the CPU arithmetic).

Prints the best of ``--loops`` loops of ``--calls`` calls per hook, in microseconds of the thread's CPU time
per hook call (torch runs single-threaded here), and the
number of rlk op calls each hook call makes. ``--profile`` adds a cProfile listing (own time) of one eager
model forward step of 64 prefill tokens with the null ops.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("RLK_TEST_VLLM_CPU_PLATFORM", "1")
for _k, _v in {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
               "RL_KERNEL_MODE": "strict", "RL_KERNEL_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN"}.items():
    os.environ[_k] = _v
os.environ.pop("RL_KERNEL_READBACK_DIR", None)
os.environ.pop("VLLM_TARGET_DEVICE", None)

import torch  # noqa: E402
from harness import best_host_us  # noqa: E402

NULL_BACKEND, NULL_CONTRACT = "rlk.bench.null", "rlk.bench.null.v1"


def build_model() -> tuple[Any, Any]:
    """The tiny Qwen3 of ``tests/vllm/test_model.py`` (bf16, 2 layers), loaded by vLLM with the plugin."""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader

    from rlk_repro.model import weights as W
    from rlk_repro.model.config import Qwen3Config

    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    d = tempfile.mkdtemp()
    W.save_checkpoint(d, cfg, W.random_weights(cfg, seed=3, dtype=torch.bfloat16))
    mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype=torch.bfloat16, enforce_eager=True)
    vc = VllmConfig(model_config=mc, compilation_config=CompilationConfig(custom_ops=["none"], mode=0))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
    return model, vc


def _null_ops(routes: Any) -> Callable[..., Any]:
    """Replace every rlk op of ``routes`` by a null op: reports like a public op, returns a cached output
    (one per op, input shape and weight). Returns the null ``linear`` (to time the null op alone)."""
    from rlk_core.readback import note_op_call

    outs: dict[tuple, torch.Tensor] = {}

    def null(op: str, shape_of: Callable[..., tuple] | None) -> Callable[..., Any]:
        def fn(*args: Any) -> Any:
            note_op_call(op, NULL_BACKEND, NULL_CONTRACT, None, "eager")
            if shape_of is None:
                return None
            key = (op, args[0].shape, id(args[1]) if len(args) > 1 else None)  # a weight by identity
            out = outs.get(key)
            if out is None:
                out = outs[key] = torch.zeros(shape_of(*args), dtype=args[0].dtype)
            return out
        return fn

    shapes: dict[str, Any] = {
        "linear": lambda x, w, b=None: (*x.shape[:-1], w.shape[0]),
        "rms_norm": lambda x, *a: tuple(x.shape),
        "swiglu": lambda x: (*x.shape[:-1], x.shape[-1] // 2),
        "rope": lambda x, *a: tuple(x.shape),
        "kv_cache_write": None,
        "attention_decode": lambda q, *a: tuple(q.shape),
        "attention_paged_prefill": lambda q, *a: tuple(q.shape),
    }
    nulls = {op: null(op, shape_of) for op, shape_of in shapes.items()}
    for op in list(routes._fns):
        if op in nulls:
            routes._fns[op] = nulls[op]
    calls = getattr(routes, "_calls", None)  # SideRoutes' (module, op) -> (function, recorder scope) table
    if calls is not None:
        for key, (_, scope) in calls.items():
            if key[1] in nulls:
                calls[key] = (nulls[key[1]], scope)
    return nulls["linear"]


def hooks(model: Any, vc: Any, tokens: int) -> dict[str, tuple[Callable[[], Any], int]]:
    """``{hook: (call, rlk op calls per call)}`` for layer 0 of ``model`` with ``tokens`` prefill tokens."""
    from rlk_vllm_plugin.attention import RlkAttentionMetadata

    layer = model.model.layers[0]
    attn = layer.self_attn
    hidden, heads, kv_heads, d = 64, 4, 2, 16
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    res = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    q = torch.randn(tokens, heads * d, dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads * d, dtype=torch.bfloat16)
    gate_up = torch.randn(tokens, 2 * 128, dtype=torch.bfloat16)
    pos = torch.arange(tokens)
    blocks, block = 64, 16
    be = attn.attn.attn_backend
    shape = be.get_kv_cache_shape(blocks, block, kv_heads, d)
    order = be.get_kv_cache_stride_order()
    raw = torch.zeros(blocks * block * kv_heads * 2 * d, dtype=torch.bfloat16)
    kv_cache = raw.view([shape[i] for i in order]).permute(*[order.index(i) for i in range(4)])
    reqs = 4
    per = tokens // reqs
    prefill = RlkAttentionMetadata(
        num_actual_tokens=tokens, num_reqs=reqs, max_query_len=per,
        query_start_loc=torch.arange(0, tokens + 1, per, dtype=torch.int32)[: reqs + 1],
        seq_lens=torch.full((reqs + 2,), per, dtype=torch.int32),
        block_table=torch.arange(reqs * 4, dtype=torch.int32).view(reqs, 4).repeat(2, 1),
        slot_mapping=torch.arange(tokens + 8, dtype=torch.int64))
    decode = RlkAttentionMetadata(
        num_actual_tokens=reqs, num_reqs=reqs, max_query_len=1,
        query_start_loc=torch.arange(reqs + 1, dtype=torch.int32),
        seq_lens=torch.full((reqs + 2,), per + 1, dtype=torch.int32),
        block_table=torch.arange(reqs * 4, dtype=torch.int32).view(reqs, 4).repeat(2, 1),
        slot_mapping=torch.arange(reqs + 8, dtype=torch.int64))
    for md in (prefill, decode):
        prepare = getattr(md, "prepare", None)
        if prepare is not None:
            prepare()
    out = torch.empty(tokens, heads * d, dtype=torch.bfloat16)
    impl = attn.attn.impl
    qkv = attn.qkv_proj
    lm = model.lm_head
    return {
        "attention prefill (impl.forward)": (lambda: impl.forward(attn.attn, q, k, k, kv_cache, prefill, out), 2),
        "attention decode (impl.forward)": (
            lambda: impl.forward(attn.attn, q[:reqs], k[:reqs], k[:reqs], kv_cache, decode, out), 2),
        "linear (qkv_proj apply)": (lambda: qkv.quant_method.apply(qkv, x), 1),
        "rms_norm (RMSNorm layer)": (lambda: layer.input_layernorm(x), 1),
        "rms_norm + residual (RMSNorm layer)": (lambda: layer.post_attention_layernorm(x, res), 1),
        "swiglu (SiluAndMul layer)": (lambda: layer.mlp.act_fn(gate_up), 1),
        "rope (RotaryEmbedding layer)": (lambda: attn.rotary_emb(pos, q, k), 2),
        "lm head (UnquantizedEmbeddingMethod.apply)": (lambda: lm.quant_method.apply(lm, x), 1),
    }


def best_us(fn: Callable[[], Any], calls: int, loops: int) -> float:
    """Microseconds of this thread's CPU time per call, best of ``loops`` loops (the host time itself,
    insensitive to other processes sharing the CPU; every call here is host work)."""
    return best_host_us(fn, calls, loops, clock=time.thread_time, warmup=max(calls // 10, 10))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--real-ops", action="store_true", help="run the real rlk ops (CPU) instead of null ops")
    ap.add_argument("--profile", action="store_true", help="cProfile one eager model forward step")
    args = ap.parse_args()

    from vllm.config import set_current_vllm_config

    from rlk_vllm_plugin import _runtime

    torch.set_num_threads(1)
    model, vc = build_model()
    rt = _runtime.get()
    null_linear = None if args.real_ops else _null_ops(rt.routes)
    from rlk_core.ops import _dispatch  # noqa: F401  (imported by the ops; keeps import time out of loops)

    print(f"vLLM plugin hook host CPU time ({'real ops' if args.real_ops else 'null ops'}, CPU, "
          f"{args.tokens} tokens, best of {args.loops} x {args.calls} calls)")
    with set_current_vllm_config(vc), torch.inference_mode():
        table = hooks(model, vc, args.tokens)
        for name, (fn, n_ops) in table.items():
            us = best_us(fn, args.calls, args.loops)
            print(f"  {name:45s} {us:8.2f} us / call   ({n_ops} rlk op call{'s' if n_ops > 1 else ''})",
                  flush=True)
        routes = rt.routes
        x = torch.randn(args.tokens, 64, dtype=torch.bfloat16)
        w = model.model.layers[0].self_attn.qkv_proj.weight
        us = best_us(lambda: routes.call("attention", "linear", x, w, None), args.calls, args.loops)
        print(f"  {'route layer + op (SideRoutes.call linear)':45s} {us:8.2f} us / call")
        us = best_us(lambda: _runtime.rlk("attention", "linear", x, w, None), args.calls, args.loops)
        print(f"  {'_runtime.rlk + route layer + op (linear)':45s} {us:8.2f} us / call")
        if null_linear is not None:
            with rt.recorder.scope("attention"):
                us = best_us(lambda: null_linear(x, w, None), args.calls, args.loops)
            print(f"  {'null op alone (in scope; subtract per op call)':45s} {us:8.2f} us / call")
        if args.profile:
            _profile(model, vc, args.tokens)
    return 0


def _profile(model: Any, vc: Any, tokens: int) -> None:
    from vllm.forward_context import set_forward_context

    from rlk_vllm_plugin.attention import RlkAttentionImpl, RlkAttentionMetadata

    names = [n for n, m in model.named_modules() if isinstance(getattr(m, "impl", None), RlkAttentionImpl)]
    md = RlkAttentionMetadata(num_actual_tokens=tokens, num_reqs=1, max_query_len=tokens,
                              query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
                              seq_lens=torch.tensor([tokens], dtype=torch.int32),
                              block_table=torch.arange(8, dtype=torch.int32)[None],
                              slot_mapping=torch.arange(tokens, dtype=torch.int64))
    for name in names:
        be = model.get_submodule(name)
        shape = be.attn_backend.get_kv_cache_shape(8, 16, be.impl.num_kv_heads, be.impl.head_size)
        be.kv_cache = torch.zeros(shape, dtype=torch.bfloat16)
    ids, pos = torch.randint(0, 320, (tokens,)), torch.arange(tokens)

    def step() -> None:
        with set_forward_context({n: md for n in names}, vc, slot_mapping={n: md.slot_mapping for n in names}):
            model.compute_logits(model(ids, pos))

    for _ in range(5):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print("cProfile, 20 eager forward steps (own time):")
    print(s.getvalue())


if __name__ == "__main__":
    sys.exit(main())
