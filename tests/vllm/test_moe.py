"""Issue 36: vLLM's ``FusedMoE`` under the plugin, on real vLLM classes on the CPU — a Qwen3-MoE checkpoint written by
the local engine (per expert, as the Hub's), loaded by vLLM's own model loader, its ``Qwen3MoeSparseMoeBlock`` run:
under ffn R the out-of-tree ``UnquantizedFusedMoEMethod`` computes rlk's block (the trainer's bits); under P vLLM's
own fused MoE runs, counted, and differs (the negative control)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

SCRIPT = """
import json, torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.plugins import load_general_plugins

load_general_plugins()
import vllm_tiny
from rlk_core.ops.moe.layer import moe_ffn
from rlk_repro.model import weights as W
from rlk_repro.model.config import PRESETS
from rlk_vllm_plugin import _runtime

cfg = PRESETS["qwen3-moe-tiny"]
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
vc, model = vllm_tiny.tiny_model(cfg, w)
out = {}
for layer in range(cfg.num_hidden_layers):
    mlp = model.model.layers[layer].mlp
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
    with set_current_vllm_config(vc), torch.no_grad(), set_forward_context(None, vc):
        y = mlp(x)
        alone = mlp(x[3:4])
    p = f"layers.{layer}."
    ref, _ = moe_ffn(x, w[p + "router"], w[p + "w13"], w[p + "w2"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out[layer] = {"equal": torch.equal(y, ref), "close": bool(torch.allclose(y.float(), ref.float(), atol=1e-3)),
                  "alone_equal": torch.equal(alone[0], y[3]),
                  "weights_as_loaded": torch.equal(mlp.experts.w13_weight, w[p + "w13"])}
method = model.model.layers[0].mlp.experts.quant_method
out["method"] = type(method).__name__
out["ffn"] = _runtime.get().recorder.to_dict()["modules"]["ffn"]
print(json.dumps(out))
print("ok")
"""


def _run(run_script, ffn: str) -> dict:
    import json

    env = {"RL_KERNEL_FFN_CASE": ffn, "RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P",
           "RL_KERNEL_MODE": "strict"}
    return json.loads(run_script(SCRIPT, env=env).strip().splitlines()[-2])


def test_fused_moe_under_ffn_r_is_rlk_s_block_bitwise(run_script):
    out = _run(run_script, "R/R")
    assert out["method"] == "RlkUnquantizedFusedMoEMethod"
    for layer in ("0", "1"):
        assert out[layer]["equal"] and out[layer]["alone_equal"] and out[layer]["weights_as_loaded"], out[layer]
    ops = out["ffn"]["ops"]
    for op in ("moe_topk", "moe_grouped_linear", "moe_combine"):
        assert ops[op]["contract_id"] == "rlk.moe.v1" and ops[op]["backend_id"].startswith("rlk."), op
    assert ops["moe_grouped_linear"]["call_count"] == 2 * ops["moe_topk"]["call_count"] > 0
    assert out["ffn"]["implementation"] == "rlk" and not out["ffn"]["fallback"]


def test_fused_moe_under_ffn_p_is_vllm_s_own_and_the_negative_control(run_script):
    out = _run(run_script, "P/P")
    assert out["method"] == "RlkUnquantizedFusedMoEMethod"  # installed for every plan: it counts P calls
    assert not any(out[layer]["equal"] for layer in ("0", "1"))  # vLLM's fused MoE: other bits than rlk's
    assert all(out[layer]["close"] for layer in ("0", "1"))  # the same block
    ops = out["ffn"]["ops"]
    assert ops["moe_grouped_linear"]["backend_id"] == "production.vllm.UnquantizedFusedMoEMethod"
    assert out["ffn"]["implementation"] == "production"


CAPTURE = """
import json, torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.plugins import load_general_plugins

load_general_plugins()
import vllm_tiny
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from rlk_core.ops.moe.layer import moe_ffn
from rlk_repro.model import weights as W
from rlk_repro.model.config import PRESETS

cfg = PRESETS["qwen3-moe-tiny"]
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
vc, model = vllm_tiny.tiny_model(cfg, w)
cap = RoutedExpertsCapturer(16, vc)  # vLLM's own record, bound to every FusedMoE's router as GPUModelRunner binds it
# (_bind_routed_experts_capturer; the GPU runner module does not import on the CPU)
moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
assert len(moes) == cfg.num_hidden_layers, moes
for module in moes:
    module.router.set_capture_fn(lambda ids, _layer=module.layer_id: cap.capture(_layer, ids))
x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
out = {}
for layer in range(cfg.num_hidden_layers):
    with set_current_vllm_config(vc), torch.no_grad(), set_forward_context(None, vc):
        model.model.layers[layer].mlp(x)
    p = f"layers.{layer}."
    _, ids = moe_ffn(x, w[p + "router"], w[p + "w13"], w[p + "w2"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    got = cap.get_device_buffer()[:7, layer]
    out[layer] = {"equal": torch.equal(got.long(), ids), "empty": not bool(got.any())}
print(json.dumps(out))
print("ok")
"""


def _capture(run_script, ffn: str) -> dict:
    import json

    env = {"RL_KERNEL_FFN_CASE": ffn, "RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P",
           "RL_KERNEL_MODE": "strict"}
    return json.loads(run_script(CAPTURE, env=env).strip().splitlines()[-2])


def test_fused_moe_under_ffn_r_fills_vllm_s_routed_experts_record(run_script):
    """``enable_return_routed_experts``: vLLM's capturer bound to the routers (as its runner binds it) holds, under ffn
    R, rlk's expert ids of every token at every layer (the rollout side of the routing diagnostic). Under P on the CPU
    vLLM's own monolithic CPU kernel selects the experts without calling the hook: the record stays empty (the
    negative control: the ids come from the plugin; on CUDA vLLM's router fills it itself)."""
    r = _capture(run_script, "R/R")
    assert all(r[layer]["equal"] for layer in ("0", "1")), r
    p = _capture(run_script, "P/P")
    assert all(p[layer]["empty"] and not p[layer]["equal"] for layer in ("0", "1")), p
