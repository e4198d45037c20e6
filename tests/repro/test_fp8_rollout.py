"""FP8 rollout on the frameworks engine (issue 38): the re-quantization of the weight sync against vLLM's own FP8
quantization, bit for bit, and the configuration's refusals. The GPU side (vLLM's CUDA ``ops.scaled_fp8_quant``,
the running engine) is ``tests/gpu/test_fp8_requant_gpu.py`` and the sitting's ``ladder`` stage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlk_repro.engine import fp8

ROUTE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "RL_KERNEL_MODE",
              "RL_KERNEL_READBACK_DIR", "RL_KERNEL_RUN_ID", "VLLM_PLUGINS", "WORLD_SIZE")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _tensors():
    g = torch.Generator().manual_seed(11)
    for shape, std in (((1, 1), 1.0), ((5, 123), 0.02), ((19, 99), 3.0), ((128, 64), 0.05), ((989, 17), 0.3)):
        yield (torch.randn(shape, generator=g) * std).to(torch.bfloat16)
    w = (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16)
    w[3, 7] = 40.0  # one outlier sets the scale: most values land in e4m3's subnormals
    yield w


def test_quantize_per_tensor_rounds_like_e4m3_with_scale_absmax_over_448():
    w = torch.tensor([[448.0, -448.0, 1.0, -0.001953125], [0.5, 96.0, -3.0, 0.0]], dtype=torch.bfloat16)
    q, s = fp8.quantize_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1,)
    assert float(s) == 1.0 and torch.equal(q.to(torch.float32), w.to(torch.float32))  # scale 1: exact in e4m3
    with pytest.raises(ValueError, match="non-zero"):
        fp8.quantize_per_tensor(torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_per_tensor(torch.ones(3, dtype=torch.bfloat16))


@pytest.mark.vllm
def test_quantize_per_tensor_equals_vllms_native_fp8_quantization_bitwise():
    """vLLM's torch implementation of its dynamic per-tensor FP8 quantization (QuantFP8.forward_native, the CPU
    stand-in of ops.scaled_fp8_quant) gives the same bytes; the negative control: a sync that keeps the old scale
    (quantizes new weights with the scale of the old ones) differs, and the check sees it."""
    script = r'''
import torch
from rlk_repro.engine import fp8
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
mod = importlib.util.spec_from_file_location("t", sys.argv[2]); t = importlib.util.module_from_spec(mod)
mod.loader.exec_module(t)
with set_current_vllm_config(VllmConfig()):
    ref = QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR)
    n = 0
    for w in t._tensors():
        q, s = fp8.quantize_per_tensor(w)
        rq, rs = ref.forward_native(w)
        assert torch.equal(t._bytes(q), t._bytes(rq)) and torch.equal(s, rs.reshape(1)), tuple(w.shape)
        if w.numel() > 1:  # negative control: the new weights quantized with the old weights' scale
            old = (w.float() * 1.5).to(torch.bfloat16)
            _, old_s = fp8.quantize_per_tensor(old)
            stale = (w.float() / old_s).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert not torch.equal(t._bytes(stale), t._bytes(rq)), tuple(w.shape)
        n += 1
print("compared", n)
print("ok")
'''
    out = _run(script, [os.path.dirname(__file__), __file__])
    assert "compared 6" in out


VLLM_FP8_SYNC = r'''
import os, tempfile, torch
import vllm._custom_ops as ops
from rlk_repro.engine import fp8
from rlk_repro.model.config import Qwen3Config
from rlk_repro.model import weights as W
from rlk_megatron_provider.weights import to_megatron, hf_from_megatron
from rlk_vllm_plugin.weight_sync import load_into_model
from vllm.config import ModelConfig, VllmConfig, CompilationConfig, LoadConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
w1, w2 = W.random_weights(cfg, 3, torch.bfloat16), W.random_weights(cfg, 5, torch.bfloat16)
d = tempfile.mkdtemp()
vc0 = VllmConfig()
with set_current_vllm_config(vc0):
    native = QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR)
def vllm_quant(x, scale=None, **kw):  # vLLM's CUDA kernel is not loaded here: its own torch implementation
    assert scale is None and not kw
    return native.forward_native(x)
ops.scaled_fp8_quant = vllm_quant   # what Fp8OnlineLinearMethod.process_weights_after_loading calls
with set_current_vllm_config(vc0):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist", local_rank=0,
                                 backend="gloo")
    initialize_model_parallel(1, 1)

def engine(weights, name, load_format="safetensors"):
    ck = os.path.join(d, name); W.save_checkpoint(ck, cfg, weights)
    mc = ModelConfig(model=ck, skip_tokenizer_init=True, dtype=torch.bfloat16, enforce_eager=True, quantization="fp8")
    vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format=load_format),
                    compilation_config=CompilationConfig(custom_ops=["none"], mode=0))
    with set_current_vllm_config(vc):
        return get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)

def same(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    u8 = lambda t: t.contiguous().view(torch.uint8)
    return [n for n in pa if not torch.equal(u8(pa[n]), u8(pb[n]))]

a, b = engine(w1, "w1"), engine(w2, "w2")   # a serves w1; b is vLLM's own FP8 load of w2
layers = fp8.fp8_linear_layers(a)
assert len(layers) == 8 and fp8.describe(a)["fp8_linear_layers"] == 8, fp8.describe(a)
assert fp8.describe(a)["other_quant_methods"] == ["Fp8KVCacheMethod", "UnquantizedEmbeddingMethod"], fp8.describe(a)
ptrs = {n: p.data_ptr() for n, p in a.named_parameters()}
before = same(a, b)
assert any(n.endswith("qkv_proj.weight") for n in before) and any(n.endswith("weight_scale") for n in before)

# negative control: the BF16 sync path (rlk_vllm_plugin.weight_sync) cannot update an FP8 engine
try:
    res = load_into_model(a, hf_from_megatron(cfg, [to_megatron(cfg, w2, 1, 0)]))
    print("bf16 path returned", res)
    assert same(a, b), "the BF16 sync path updated an FP8 engine?"
except (RuntimeError, AssertionError) as exc:  # vLLM's loader asserts: a BF16 shard cannot fill an FP8 weight
    print("bf16 path refused:", type(exc).__name__, str(exc)[:160])
a = engine(w1, "w1", "dummy")  # as the frameworks engine starts vLLM: dummy weights, the trainer's follow
ptrs = {n: p.data_ptr() for n, p in a.named_parameters()}

with set_current_vllm_config(vc0):
    res = fp8.load_into_fp8_model(a, hf_from_megatron(cfg, [to_megatron(cfg, w2, 2, r) for r in range(2)]),
                                  reference=native.forward_native)
print("sync", res)
assert res["requantized"] == 8 and res["checked_against_vllm"] == 8, res
assert same(a, b) == [], same(a, b)  # the sync's FP8 bytes and scales are vLLM's own load of w2
assert {n: p.data_ptr() for n, p in a.named_parameters()} == ptrs  # in place: CUDA graphs keep their addresses
assert all(type(m.weight) is torch.nn.Parameter for _, m in fp8.fp8_linear_layers(a))  # the staging is gone
with set_current_vllm_config(vc0):
    again = fp8.load_into_fp8_model(a, hf_from_megatron(cfg, [to_megatron(cfg, w2, 1, 0)]),
                                    reference=native.forward_native)
assert again["changed"] == 0, again
try:  # a reference that disagrees stops the sync
    with set_current_vllm_config(vc0):
        fp8.load_into_fp8_model(a, hf_from_megatron(cfg, [to_megatron(cfg, w1, 1, 0)]),
                                reference=lambda x: native.forward_native(x.flip(0)))
except RuntimeError as exc:
    assert "differs from vLLM" in str(exc), exc
else:
    raise AssertionError("a differing reference was not reported")
# the refused sync wrote no FP8 layer and restored their parameters (vLLM's loaders had already written the BF16 ones)
assert [n for n in same(a, b) if "proj" in n] == [] and same(a, b)
assert all(type(m.weight) is torch.nn.Parameter for _, m in fp8.fp8_linear_layers(a))
try:
    fp8.load_into_fp8_model(a, [(n, t) for n, t in hf_from_megatron(cfg, [to_megatron(cfg, w2, 1, 0)])
                                if "down_proj" not in n], reference=native.forward_native)
except RuntimeError as exc:
    assert "received no weight" in str(exc), exc
else:
    raise AssertionError("a missing weight was not reported")
print("ok")
'''


def _run(body: str, args: list[str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ROUTE_VARS}
    env.update(PYTHONWARNINGS="ignore", VLLM_TARGET_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body), *(args or [])], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_fp8_weight_sync_equals_vllms_own_fp8_load_bitwise(tmp_path):
    """Real vLLM 0.22 Qwen3 with quantization='fp8' (the online method, vLLM's loaders, TP-2 shards merged by
    hf_from_megatron), started from dummy weights as the frameworks engine starts it: after the sync every
    parameter — FP8 weight bytes in kernel layout, scales, BF16 norms and embedding — equals a fresh vLLM FP8 load
    of the new weights, in place; a sync of the same weights changes nothing; a reference that disagrees, or a
    missing weight, raises. Negative control: the BF16 sync path cannot update the FP8 engine (vLLM's loader
    asserts) or leaves it at the old weights."""
    out = _run(VLLM_FP8_SYNC)
    assert "bf16 path" in out


def test_config_refuses_fp8_with_an_r_rollout_side():
    assert fp8.config_problem("none", {"attention": "R", "ffn": "R", "logp": "R"}) is None
    assert fp8.config_problem("fp8", {"attention": "P", "ffn": "P", "logp": "P"}) is None
    why = fp8.config_problem("fp8", {"attention": "P", "ffn": "R", "logp": "R"})
    assert "ffn, logp" in why and "X/P" in why
    assert "one of none, fp8" in fp8.config_problem("int4", {})
    assert "V1 runner" in fp8.config_problem("fp8", {"attention": "P"}, cuda_graph_decode=True)
