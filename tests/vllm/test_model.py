"""A tiny Qwen3 built by real vLLM with every layer hooked, run on a paged KV cache (chunked prefill, then
decode) through the plugin's layers and attention impl: its log-probs equal rlk's training-side recompute
(rlk_repro's trainer: varlen attention, fused ``linear_logprobs``) bit for bit; coverage: no linear, norm,
activation or RoPE of an R module runs outside rlk."""

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = r'''
import os, tempfile, torch
from vllm.plugins import load_general_plugins
load_general_plugins()
from rlk_vllm_plugin import _runtime, layers, logprobs
from rlk_vllm_plugin.attention import RlkAttentionMetadata
from rlk_repro.model.config import Qwen3Config
from rlk_repro.model import weights as W
cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
d = tempfile.mkdtemp(); W.save_checkpoint(d, cfg, w)
from vllm.config import ModelConfig, VllmConfig, CompilationConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model_loader
mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype=torch.bfloat16, enforce_eager=True)
vc = VllmConfig(model_config=mc, compilation_config=CompilationConfig(custom_ops=[CUSTOM_OPS], mode=0))
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist", local_rank=0,
                                 backend="gloo")
    initialize_model_parallel(1, 1)
    model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)

# coverage: every leaf layer is hooked (OOT class bound to a module, linear with a module prefix, the
# attention impl) or exact by construction (embedding gather); nothing else computes
oot = tuple(layers._CLASSES.values())
from rlk_vllm_plugin.attention import RlkAttentionImpl
for name, m in model.named_modules():
    if list(m.children()) and not isinstance(m, oot):
        continue
    kind = type(m).__name__
    if isinstance(m, oot):
        assert getattr(m, "_rlk_module", None) in ("attention", "ffn", "logp"), name
    elif kind.endswith("Linear"):
        assert _runtime.module_of(m.prefix) in ("attention", "ffn"), name
    elif kind == "Attention":
        assert isinstance(m.impl, RlkAttentionImpl), name
    else:
        assert kind in ("VocabParallelEmbedding", "ParallelLMHead", "LogitsProcessor", "ApplyRotaryEmb"), (name, kind)

torch.manual_seed(0)
seq = torch.randint(0, cfg.vocab_size, (26,)).tolist()
chunks = [(0, 13), (13, 21), (21, 22), (22, 23), (23, 24), (24, 25)]  # chunked prefill, then decode
B, N, T = 8, 16, 0.7
kv = {}
for name, m in model.named_modules():
    if isinstance(getattr(m, "impl", None), RlkAttentionImpl):
        be = m.attn_backend  # allocate exactly as vLLM 0.22's runner does: raw.view(physical).permute(inverse)
        shape = be.get_kv_cache_shape(B, N, m.impl.num_kv_heads, m.impl.head_size)
        order = be.get_kv_cache_stride_order()
        raw = torch.zeros(B * N * m.impl.num_kv_heads * 2 * m.impl.head_size, dtype=torch.bfloat16)
        m.kv_cache = kv[name] = raw.view([shape[i] for i in order]).permute(*[order.index(i) for i in range(4)])
block_table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
outs = []
for a, b in chunks:
    ids, pos = torch.tensor(seq[a:b]), torch.arange(a, b)
    slots = torch.tensor([int(block_table[0, p // N]) * N + p % N for p in range(a, b)], dtype=torch.int64)
    md = RlkAttentionMetadata(num_actual_tokens=b - a, num_reqs=1, max_query_len=b - a,
                              query_start_loc=torch.tensor([0, b - a], dtype=torch.int32),
                              seq_lens=torch.tensor([b], dtype=torch.int32), block_table=block_table,
                              slot_mapping=slots)
    with set_current_vllm_config(vc), set_forward_context({n: md for n in kv}, vc, slot_mapping={n: slots for n in kv}):
        logits = model.compute_logits(model(ids, pos))
    temperature = torch.full((b - a,), T, dtype=torch.float32)
    token = logprobs._STEP.set({"logits": logits, "temperature": temperature, "kept": None})
    try:
        outs.append(logprobs.token_logprobs_hook(logits, torch.tensor(seq[a + 1:b + 1])[:, None])[:, 0])
    finally:
        logprobs._STEP.reset(token)
roll = torch.cat(outs)

from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_repro.model.ops import Ops
from rlk_repro.engine.trainer import Trainer
def train(plan):
    tr = Trainer(cfg, w, Ops(plan, "train", ReadbackRecorder("megatron", "train", plan)), device=torch.device("cpu"),
                 dtype=torch.bfloat16, temperature=T)
    with torch.no_grad():
        return tr.forward_logprobs([seq])[:25]
assert torch.equal(roll, train(RoutePlan.preset("consistency"))), "rollout != train"
assert not torch.equal(roll, train(RoutePlan("R/R", "P/R", "R/R"))), "negative control: train ffn P must differ"

mods = _runtime.current().recorder.to_dict()["modules"]
L = cfg.num_hidden_layers
calls = {m: {op: r["call_count"] for op, r in mods[m]["ops"].items()} for m in mods}
assert all(mods[m]["implementation"] == "rlk" and not mods[m]["fallback"] for m in mods), mods
steps = len(chunks)
assert calls["attention"]["linear"] == 2 * L * steps and calls["attention"]["rms_norm"] == 3 * L * steps, calls
assert calls["attention"]["rope"] == 2 * L * steps and calls["attention"]["kv_cache_write"] == L * steps, calls
assert calls["attention"]["attention_paged_prefill"] == 2 * L and calls["attention"]["attention_decode"] == 4 * L
assert calls["ffn"] == {"linear": 2 * L * steps, "rms_norm": L * steps, "swiglu": L * steps}, calls
assert calls["logp"] == {"rms_norm": steps, "linear": steps, "token_logprobs": steps}, calls
print("ok")
'''

ENV = {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
       "RL_KERNEL_MODE": "strict", "RL_KERNEL_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN"}


@pytest.mark.parametrize("custom_ops", ["none", "all"], ids=["forward_native", "forward_cpu"])
def test_tiny_qwen3_all_r_rollout_equals_training_recompute_bitwise(run_script, custom_ops):
    # custom_ops 'none' (vLLM's compile default) dispatches every CustomOp to forward_native, 'all' (its
    # enforce_eager default) to the platform method: both must reach rlk.
    run_script(SCRIPT.replace("CUSTOM_OPS", repr(custom_ops)), env=ENV)
